"""The output's shards: one Megatron indexed dataset per key (and a conversation's roles beside
it, a prompt's columns), appended batch by batch in input order."""

from __future__ import annotations

import re

import numpy as np

from mega_tokenize.encoding import Encoded
from mega_tokenize.parsing import Parsed
from mega_tokenize.prompts import COLUMNS_SUFFIX, write_columns
from megacore.artifacts import ArtifactWriter
from megacore.artifacts import manifest as mf
from megacore.data.indexed import IndexedWriter


def safe_name(key: str) -> str:
    """A json key as a shard's file name (`shards/<name>.bin`)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key) or "text"


class Shards:
    """The output's shards: one per key, and with `chat` (documents of segments: conversations or
    preference pairs, one key) `<key>.roles` beside it (a role code per token, `chat.roles` for
    chat), and with `columns` the rows' other columns (prompts: `<key>.columns.parquet`, written at
    close); batches are appended in input order, the sums computed while writing."""

    def __init__(
        self,
        w: ArtifactWriter,
        keys: list[str],
        dtype: str,
        bos: int | None,
        eos: int | None,
        chat: bool,
        columns: bool = False,
    ) -> None:
        self.w, self.keys, self.bos, self.eos = w, keys, bos, eos
        self.rows: list[dict] | None = [] if columns else None
        self.column_types: dict[str, str] = {}
        self.writers = {k: IndexedWriter(w.path(f"shards/{safe_name(k)}"), dtype) for k in keys}
        self.sidecar = f"shards/{safe_name(keys[0])}.roles"
        self.roles = IndexedWriter(w.path(self.sidecar), "uint8") if chat else None
        self.every = [*self.writers.values(), *([self.roles] if self.roles is not None else [])]

    def write(self, parsed: Parsed, encoded: Encoded) -> tuple[int, int]:
        """Append one batch; (documents, tokens) it added."""
        ndocs = ntok = 0
        for k, (flat, lengths) in encoded.items():
            if parsed.chats is not None:
                ndocs, ntok = _assemble_chats(
                    parsed.chats, flat, lengths, self.bos, self.eos, self.writers[k], self.roles
                )
            else:
                self.writers[k].add(flat, lengths)
                ndocs, ntok = len(lengths), ntok + len(flat)
        if self.rows is not None:
            self.rows += parsed.columns
        return ndocs, ntok

    def close(self) -> None:
        """Finish every file and record its sums with the artifact (commit need not reread them)."""
        for wr in self.every:
            wr.close()
            self.w.record(f"shards/{wr.prefix.name}.bin", wr.bin_sha256)
            self.w.record(f"shards/{wr.prefix.name}.idx", wr.idx_sha256)
        if self.rows is not None:
            self.column_types = write_columns(self.rows, self.w.path(self._columns))

    @property
    def _columns(self) -> str:
        return f"shards/{safe_name(self.keys[0])}{COLUMNS_SUFFIX}"

    def abort(self) -> None:
        for wr in self.every:
            wr.abort()

    @property
    def documents(self) -> int:
        return self.writers[self.keys[0]].documents

    def entries(self) -> list[mf.Shard]:
        """The manifest's shard entries."""
        sidecars = {"roles": self.sidecar} if self.roles is not None else {}
        return [
            mf.Shard(
                prefix=f"shards/{safe_name(k)}",
                json_key=k,
                documents=self.writers[k].documents,
                tokens=self.writers[k].tokens,
                sidecars=sidecars,
                columns=self._columns if self.column_types else None,
            )
            for k in self.keys
        ]


def _assemble_chats(
    chats, flat: np.ndarray, lengths: np.ndarray, bos, eos, writer: IndexedWriter, roles_writer
) -> tuple[int, int]:
    """Conversations from their text pieces' ids (encoded in one engine call) and marker ids."""
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids_parts: list[np.ndarray] = []
    role_parts: list[np.ndarray] = []
    doc_lengths = np.empty(len(chats), dtype=np.int64)
    ti = 0
    for ci, chat in enumerate(chats):
        n = 0
        if bos is not None:
            ids_parts.append(np.array([bos], np.uint32))
            role_parts.append(np.zeros(1, np.uint8))
            n += 1
        for p in chat:
            if p.text is None:
                ids = np.array([p.token], np.uint32)
            else:
                ids = flat[offsets[ti] : offsets[ti + 1]]
                ti += 1
            ids_parts.append(ids)
            role_parts.append(np.full(len(ids), p.role, np.uint8))
            n += len(ids)
        if eos is not None:
            ids_parts.append(np.array([eos], np.uint32))
            role_parts.append(np.zeros(1, np.uint8))
            n += 1
        doc_lengths[ci] = n
    all_ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.uint32)
    all_roles = np.concatenate(role_parts) if role_parts else np.zeros(0, np.uint8)
    writer.add(all_ids, doc_lengths)
    roles_writer.add(all_roles, doc_lengths)
    return len(chats), len(all_ids)
