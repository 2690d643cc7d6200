"""Prompts for online RL (`mega-tokenize --format prompts`) as a source of samples, and the columns
kept beside them.

`PromptIndex`: a sample is one prompt. A split is a range of prompts (`split_ranges`, as documents);
each epoch shuffles the split's prompts on its own, from `np.random.default_rng([seed, source_id,
split_id, epoch])` as every index does, so the first N samples are the same however many are asked
for. A prompt that leaves no room in a row for `completion_length` tokens after it (rows of
`seq_length + 1` tokens: prompt then completion) is left out, never cut (`skipped` counts them, for a
warning). A sample's row holds its prompt then PAD; `document(i)` is its global document id, which
the objective reads the prompt's tokens and columns by.

`PromptColumns`: the rows themselves (the prompt as given, and the other columns), each shard's
`columns` Parquet file, one row per document
in the shard's order, read whole (prompt sets are small) and looked up by global document id, as
`Documents` numbers them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megacore.artifacts.header import MANIFEST_NAME
from megacore.artifacts.manifest import TokensManifest
from megacore.data.documents import Documents
from megacore.data.packing import document_row
from megacore.data.samples import SPLITS, SplitIndex, split_lengths
from megacore.errors import UserError


class PromptIndex(SplitIndex):
    """The samples of one split of one prompts source (module docstring). Array `order`: every
    epoch's shuffled prompts that fit (positions among the split's documents), epoch after epoch."""

    ARRAYS = ("order",)

    def __init__(
        self,
        docs: Documents,
        doc_range: tuple[int, int],
        seq_length: int,
        num_samples: int,
        order: np.ndarray,
        completion_length: int = 0,
    ) -> None:
        super().__init__(docs, doc_range, seq_length, num_samples)
        self.order = order
        lengths = docs.lengths[doc_range[0] : doc_range[1]]
        self.skipped = int((lengths > seq_length + 1 - completion_length).sum())

    @classmethod
    def build(
        cls,
        docs: Documents,
        doc_range: tuple[int, int],
        *,
        split_id: int,
        seq_length: int,
        num_samples: int,
        seed: int,
        source_id: int = 0,
        where: str | None = None,
        completion_length: int = 0,
    ) -> PromptIndex:
        """Shuffle as many epochs of the prompts that fit as `num_samples` samples need."""
        room = seq_length + 1 - completion_length
        fit = np.flatnonzero(split_lengths(docs, doc_range, split_id, where) <= room)
        if len(fit) == 0:
            raise UserError(
                f"every prompt of the {SPLITS[split_id]} split of {docs.path} is longer than "
                f"seq_length + 1 - max_completion_length = {room} tokens",
                where,
            )
        orders, epoch = [], 0
        while sum(map(len, orders)) < num_samples:
            rng = np.random.default_rng([seed % 2**64, source_id, split_id, epoch])
            orders.append(fit[rng.permutation(len(fit))])
            epoch += 1
        order = np.concatenate(orders)[:num_samples]
        return cls(docs, doc_range, seq_length, num_samples, order, completion_length)

    def document(self, i: int) -> int:
        """Sample i's global document id."""
        self._check(i)
        return self.first_doc + int(self.order[i])

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Sample i: int64 tokens [seq_length + 1] (its prompt, PAD after it), their uint8 role codes
        (PAD_ROLE there) or None, and int64 positions from 0."""
        return document_row(self.docs, self.document(i), self.seq_length)


class PromptColumns:
    """The rows' columns (`prompt`, `answer`, `solution`...) of a prompts artifact at `path`, typed as the
    manifest's `column_types` say; `rows(docs)` gives them by global document id, as the reward
    functions take them (one list per column)."""

    def __init__(self, path: Path, manifest: TokensManifest) -> None:
        import pyarrow.parquet as pq

        root = Path(path).parent if Path(path).name == MANIFEST_NAME else Path(path)
        where = str(root / MANIFEST_NAME)
        self.types = dict(manifest.column_types)
        tables = []
        for i, shard in enumerate(manifest.shards):
            if shard.columns is None:  # rows with a prompt alone
                if self.types:
                    raise UserError(f"$.shards[{i}].columns: missing, for the columns {self.names}", where)
                continue
            table = pq.read_table(root / shard.columns)
            got = {f.name: str(f.type) for f in table.schema}
            if table.num_rows != shard.documents or got != self.types:
                raise UserError(
                    f"$.shards[{i}].columns: {table.num_rows} rows of {got}, the manifest says "
                    f"{shard.documents} of {self.types}",
                    where,
                )
            tables.append(table)
        self._columns = {name: [v for t in tables for v in t.column(name).to_pylist()] for name in self.types}

    @property
    def names(self) -> list[str]:
        return list(self.types)

    def rows(self, docs: list[int] | np.ndarray) -> dict[str, list]:
        """Each column's values for documents `docs`, in that order."""
        return {name: [values[int(d)] for d in docs] for name, values in self._columns.items()}
