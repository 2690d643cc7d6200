"""The documents of one tokens artifact, over all its shards, as one list numbered from 0.

Sample building (`samples.py`) works on global document ids so that the train/valid/test split and
the shuffles do not care how mega-tokenize cut the artifact into shards. Every shard stays
memory-mapped (`IndexedReader`); only the document lengths are read up front.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megacore.artifacts.header import MANIFEST_NAME
from megacore.artifacts.manifest import TokensManifest
from megacore.data.indexed import IndexedReader
from megacore.errors import UserError


class Documents:
    """Documents of a tokens artifact at `path` (its directory or its manifest.json).

    `lengths[d]` is document d's token count; `tokens(d)` and `roles(d)` read it (or a part of it)
    from the shard that holds it. A global id maps to (shard, local id) through `starts`, the
    cumulative document count of the shards before each one.
    """

    def __init__(self, path: Path, manifest: TokensManifest) -> None:
        self.path = Path(path).parent if Path(path).name == MANIFEST_NAME else Path(path)
        self._tokens = [IndexedReader(self.path / s.prefix) for s in manifest.shards]
        for i, (shard, reader) in enumerate(zip(manifest.shards, self._tokens, strict=True)):
            if len(reader) != shard.documents:
                raise UserError(
                    f"$.shards[{i}]: the shard holds {len(reader)} documents, the manifest says "
                    f"{shard.documents}",
                    str(self.path / MANIFEST_NAME),
                )
        self.lengths = np.concatenate(
            [r.sequence_lengths.astype(np.int64) for r in self._tokens] or [np.zeros(0, np.int64)]
        )
        self.starts = np.zeros(len(self._tokens) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in self._tokens], out=self.starts[1:])
        self._roles = self._open_roles(manifest)

    def _open_roles(self, manifest: TokensManifest) -> list[IndexedReader] | None:
        """The `roles` sidecar of every shard (one uint8 code per token), or None without one. A
        sidecar whose documents differ in length from its shard's would silently misalign every
        label after the first difference, so that is refused here."""
        with_roles = ["roles" in s.sidecars for s in manifest.shards]
        if not any(with_roles):
            return None
        where = str(self.path / MANIFEST_NAME)
        if not all(with_roles):
            raise UserError("$.shards: some shards have a roles sidecar and some do not", where)
        readers = [IndexedReader(self.path / s.sidecars["roles"]) for s in manifest.shards]
        for i, (roles, tokens) in enumerate(zip(readers, self._tokens, strict=True)):
            if roles.dtype != np.uint8 or not np.array_equal(roles.sequence_lengths, tokens.sequence_lengths):
                raise UserError(
                    f'$.shards[{i}].sidecars["roles"]: not one uint8 code per token of the shard', where
                )
        return readers

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def has_roles(self) -> bool:
        return self._roles is not None

    def _locate(self, doc: int) -> tuple[int, int]:
        if not 0 <= doc < len(self.lengths):
            raise IndexError(f"document {doc} out of range (0..{len(self.lengths) - 1})")
        shard = int(np.searchsorted(self.starts, doc, side="right")) - 1
        return shard, doc - int(self.starts[shard])

    def tokens(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """`length` tokens of document `doc` from `offset` (all the rest when None): a mapped view."""
        shard, local = self._locate(doc)
        return self._tokens[shard].get(local, offset, length)

    def roles(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray | None:
        """The role codes of the same tokens as `tokens(doc, offset, length)`, or None."""
        if self._roles is None:
            return None
        shard, local = self._locate(doc)
        return self._roles[shard].get(local, offset, length)
