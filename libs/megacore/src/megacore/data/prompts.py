"""The columns a prompts artifact (`mega-tokenize --format prompts`) keeps beside its prompts' tokens:
each shard's `columns` Parquet file, one row per document in the shard's order, read whole (prompt
sets are small) and looked up by global document id, as `Documents` numbers them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megacore.artifacts.header import MANIFEST_NAME
from megacore.artifacts.manifest import TokensManifest
from megacore.errors import UserError


class PromptColumns:
    """The rows' other columns (`answer`, `solution`...) of a prompts artifact at `path`, typed as the
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
