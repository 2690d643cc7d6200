"""A tokenizer's files read without torch or the tokenizer libraries (a dry run and a training job
have neither sentencepiece nor `tokenizers` to rely on): a SentencePiece `.model`'s protobuf
(`read_sentencepiece`; megacore.models.hf_tokenizer builds its tokenizer.json from it), a
tokenizer.json's ids (`id_to_token`), and the vocabulary (id -> token) of the tokenizer an artifact
records (`recorded_vocabulary`).

Two tokenizers are the same for training when they map every id to the same token
(`first_difference`), whatever their files: a `.model` and the tokenizer.json made from it are one
tokenizer; two `.model`s of the same size trained on different text are not.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from megacore.artifacts.manifest import CheckpointManifest, TokenizerInfo, TokensManifest
from megacore.artifacts.reader import artifact_root
from megacore.errors import UserError

# ChatML's markers: mega-tokenize renders chat data with them, mega-export writes the template.
CHATML_START, CHATML_END = "<|im_start|>", "<|im_end|>"

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # SentencePiece.Type
UNIGRAM, BPE = 1, 2  # TrainerSpec.ModelType


@dataclass(frozen=True)
class SentencePieceModel:
    """What encoding depends on, from a `.model` (ModelProto; defaults as its schema gives them)."""

    pieces: list[tuple[str, float, int]]  # (piece, score, type) by id
    model_type: int = UNIGRAM
    byte_fallback: bool = False
    unk_id: int = 0
    treat_whitespace_as_suffix: bool = False
    charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a protobuf message: varints as ints, the rest as their bytes."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        kind = key & 7
        if kind == 0:
            value, i = _varint(buf, i)
        elif kind in (1, 5):
            n = 8 if kind == 1 else 4
            value, i = buf[i : i + n], i + n
        elif kind == 2:
            n, i = _varint(buf, i)
            value, i = buf[i : i + n], i + n
        else:
            raise ValueError(f"not a SentencePiece model (protobuf wire type {kind})")
        yield key >> 3, value


def read_sentencepiece(raw: bytes) -> SentencePieceModel:
    """Parse a `.model` file's bytes (ModelProto: pieces 1, trainer_spec 2, normalizer_spec 3)."""
    pieces, trainer, normalizer = [], {}, {}
    for num, value in _fields(raw):
        if num == 1:
            f = dict(_fields(value))
            score = struct.unpack("<f", f[2])[0] if 2 in f else 0.0
            pieces.append((f.get(1, b"").decode("utf-8"), score, f.get(3, NORMAL)))
        elif num == 2:
            trainer = dict(_fields(value))
        elif num == 3:
            normalizer = dict(_fields(value))
    if not pieces:
        raise ValueError("not a SentencePiece model (no pieces)")
    unk = trainer.get(40, 0)
    return SentencePieceModel(
        pieces=pieces,
        model_type=trainer.get(3, UNIGRAM),
        byte_fallback=bool(trainer.get(35, 0)),
        unk_id=unk - (1 << 64) if unk >= 1 << 63 else unk,  # int32 varints are sign-extended
        treat_whitespace_as_suffix=bool(trainer.get(24, 0)),
        charsmap=normalizer.get(2, b""),
        add_dummy_prefix=bool(normalizer.get(3, 1)),
        remove_extra_whitespaces=bool(normalizer.get(4, 1)),
        escape_whitespaces=bool(normalizer.get(5, 1)),
    )


def id_to_token(data: dict) -> dict[int, str]:
    """Every id a tokenizer.json can produce and its token: the model's vocab and the added tokens."""
    vocab = data["model"].get("vocab", {})
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel
        names = {i: t for t, i in vocab.items()}
    else:  # Unigram: [[piece, score], ...] by id
        names = {i: t for i, (t, _) in enumerate(vocab)}
    names.update({t["id"]: t["content"] for t in data.get("added_tokens", [])})
    return names


def vocabulary(path: Path, added: Mapping[str, int] | None = None) -> dict[int, str]:
    """id -> token of a tokenizer file, a tokenizer.json or a SentencePiece `.model`, with the
    special tokens `added` past its vocab (`TokenizerInfo.added_special_tokens`)."""
    try:
        if path.suffix == ".json":
            names = id_to_token(json.loads(path.read_text(encoding="utf-8")))
        else:
            names = dict(enumerate(p for p, _, _ in read_sentencepiece(path.read_bytes()).pieces))
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, struct.error) as e:
        reason = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise UserError(f"cannot read the tokenizer's vocabulary ({reason})", str(path)) from None
    names.update({i: token for token, i in (added or {}).items()})
    return names


def _tokenizer_file(files: Sequence[str], kind: str | None = None) -> str | None:
    """The file that defines the ids, as mega-tokenize picks it in a tokenizer directory:
    tokenizer.json, else the `.model`; a tokenizer.json given under another name (`kind` "hf") is
    listed first."""
    jsons = [f for f in files if Path(f).name == "tokenizer.json"]
    models = [f for f in files if f.endswith(".model")]
    if jsons or models:
        return (jsons + models)[0]
    return files[0] if kind == "hf" and files else None


def recorded_vocabulary(path: Path, manifest: CheckpointManifest | TokensManifest) -> dict[int, str] | None:
    """The vocabulary of the tokenizer the artifact at `path` records: a tokens artifact's or a
    trained checkpoint's `tokenizer`, else the `tokenizer_files` mega-convert copied; None when it
    records none."""
    root = artifact_root(path)
    record = manifest.tokenizer
    info = record if isinstance(record, TokenizerInfo) or record is None else record.info
    if info is not None:
        files, kind, added = info.files, info.type, info.added_special_tokens
    else:
        files, kind, added = getattr(manifest, "tokenizer_files", []), None, {}
    rel = _tokenizer_file(files, kind)
    return None if rel is None else vocabulary(root / rel, added)


def first_difference(a: Mapping[int, str], b: Mapping[int, str]) -> tuple[int, str, str] | None:
    """The lowest id both tokenizers have and map to different tokens, with `a`'s and `b`'s token;
    None when they agree on every id they share. An id only one of them has is no difference: data
    never holds an id its tokenizer lacks, and ids past the other's vocab are tokens added to it
    (ChatML markers) whose embedding rows the other's never used."""
    return next(((i, a[i], b[i]) for i in sorted(a.keys() & b.keys()) if a[i] != b[i]), None)
