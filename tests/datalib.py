"""Tokens artifacts for megacore.data tests (tests/ is on the path): documents whose tokens say
where they came from."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from megacore.artifacts import TokensManifest, new_header_fields, open_artifact, write_artifact
from megacore.artifacts.manifest import Shard, TokenizerInfo
from megacore.data.indexed import IndexedWriter

S = 16  # seq_length


def make_tokens(
    out: Path, shard_lengths: list[list[int]], *, base: int = 0, roles: bool = False, force: bool = False
) -> tuple[Path, TokensManifest, list[list[int]]]:
    """A tokens artifact whose tokens are base, base+1, ... in document order (so every token tells
    where it came from), roles = token % 5; returns it with its documents as Python lists."""
    docs: list[list[int]] = []
    shards = []
    with write_artifact(out, "tokens", force=force) as w:
        for s, lengths in enumerate(shard_lengths):
            n = sum(lengths)
            flat = (base + sum(map(len, docs)) + np.arange(n)) % 65536
            at = np.cumsum([0, *lengths])
            docs += [flat[a:b].tolist() for a, b in itertools.pairwise(at)]
            prefixes = {"tokens": f"shards/s{s}", "roles": f"shards/s{s}.roles"}
            for what, prefix in prefixes.items():
                if what == "roles" and not roles:
                    continue
                wr = IndexedWriter(w.path(prefix), "uint16" if what == "tokens" else "uint8")
                wr.add(flat if what == "tokens" else (flat % 5).astype(np.uint8), np.array(lengths))
                wr.close()
                w.record(f"{prefix}.bin", wr.bin_sha256)
                w.record(f"{prefix}.idx", wr.idx_sha256)
            sidecars = {"roles": prefixes["roles"]} if roles else {}
            shards.append(
                Shard(
                    prefix=prefixes["tokens"],
                    json_key="text",
                    documents=len(lengths),
                    tokens=n,
                    sidecars=sidecars,
                )
            )
        tokenizer = TokenizerInfo(type="sentencepiece", files=[], vocab_size=65536, fingerprint="test")
        w.commit(
            TokensManifest(
                **new_header_fields("tests", "0"), tokenizer=tokenizer, dtype="uint16", shards=shards
            )
        )
    return out, open_artifact(out, "tokens"), docs


def lengths(seed: int, n: int, high: int = 3 * S) -> list[int]:
    return np.random.default_rng(seed).integers(1, high, size=n).tolist()
