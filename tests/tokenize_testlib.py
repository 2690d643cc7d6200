"""Helpers shared by the tests (tests/ is on the path): real text to train tokenizers on and corpora."""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

# ChatML as a tokenizer's own template (Qwen's, without its default system prompt).
CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def training_text() -> list[str]:
    """Real English and code: the docstrings and sources of a few stdlib modules."""
    import argparse
    import json as json_mod
    import textwrap as tw

    lines = []
    for mod in (argparse, json_mod, tw):
        lines += [ln for ln in inspect.getsource(mod).splitlines() if ln.strip()]
    lines += ["émigré naïve café Ünïcödé 漢字 😀", "<s> literal tags </s>", "tabs\tand  spaces"]
    return lines


def train_bpe(lines: list[str], vocab_size: int) -> bytes:
    """A SentencePiece BPE model (byte fallback; unk 0, bos 1, eos 2, no pad) trained on `lines`."""
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=0.9995,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
        minloglevel=2,
    )
    return buf.getvalue()


def write_jsonl(path: Path, records: list, compress: str | None = None) -> Path:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    if compress == "zst":
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    elif compress == "gz":
        import gzip

        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def corpus(n: int = 300) -> list[str]:
    """Documents of varied length built from real text, with the usual traps mixed in."""
    src = training_text()
    docs = []
    for i in range(n):
        body = "\n".join(src[(i * 7) % len(src) : (i * 7) % len(src) + 1 + i % 9])
        if i % 17 == 0:
            body += " <s> and </s> typed by a user"
        if i % 23 == 0:
            body = "  " + textwrap.indent(body, "    ") + "  "
        docs.append(body)
    return docs


def documents(tokens: Path, sidecar: str | None = None) -> list[list[int]]:
    """A tokens artifact's documents in order (every shard), as id lists; with `sidecar` (e.g.
    "roles"), that sidecar's rows instead."""
    from megacore.artifacts import open_artifact
    from megacore.data.indexed import IndexedReader

    docs = []
    for shard in open_artifact(tokens, "tokens").shards:
        reader = IndexedReader(tokens / (shard.sidecars[sidecar] if sidecar else shard.prefix))
        docs += [reader[i].tolist() for i in range(len(reader))]
    return docs


# mega-tokenize's arguments that add ChatML's markers to a tokenizer (chat data in tests).
CHATML = ["--add-special-tokens", "<|im_start|>,<|im_end|>"]
