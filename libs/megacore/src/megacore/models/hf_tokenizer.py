"""The tokenizer a model was trained with, as files a Hugging Face directory loads
(`hf_tokenizer_files`): `AutoTokenizer.from_pretrained` then encodes text exactly as the training
data was encoded, with the special tokens added for it (ChatML markers) at their ids, the chat
template the data was rendered with, and `generation_config.json` with every end-of-turn id.

A SentencePiece `.model` becomes a `tokenizer.json` that encodes exactly as sentencepiece does,
read from the model file itself (its protobuf, parsed by megacore.tokenizer_files: no protobuf
package needed). It is the one conversion: mega-tokenize's `hf` and `gigatoken` engines encode
with this same file, so the ids written at tokenize time and the exported tokenizer cannot drift.

transformers' own conversion of a `.model` disagrees with sentencepiece on most real documents
(transformers 5: BPE merges ranked by piece id instead of score, a Metaspace pre-tokenizer that
splits where sentencepiece does not). What sentencepiece does, and what is written here:
- normalization: the model's precompiled character map (`Precompiled`), then, when the model says
  so, leading and trailing spaces dropped and runs of spaces collapsed (`_remove_extra_whitespaces`:
  in a form gigatoken also reads wherever the map leaves spare characters, as nmt_nfkc and nfkc
  maps do), a space prepended (the "dummy prefix") and spaces escaped as U+2581;
- no pre-tokenization: BPE merges over the whole normalized text, a pair merged when the piece it
  makes is in the vocab, the highest-scoring such piece first (so the merges are every split of
  every piece into two pieces, ranked by the merged piece's score), unknown characters as bytes
  with byte fallback;
- control pieces (`<s>`, `</s>`) and `<unk>` are special added tokens: never produced by text.

Measured on the Mistral 7B tokenizer and on BPE models trained here (nmt_nfkc, nfkc and identity
normalization, with and without extra-whitespace removal): the same ids as sentencepiece on 200-300
Python source files and a set of whitespace and Unicode edge cases (tests/tokenize/
test_one_converter.py); transformers 5's own conversion differed on 193 of 208. Refused, as no
tokenizer.json encodes exactly like them: unigram models (`tokenizers`' Viterbi breaks ties between
equal-scoring segmentations differently: 1-2 files in 300 differed) and models with user-defined
pieces (see `sentencepiece_tokenizer_json`).
"""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from megacore.tokenizer_files import (
    BPE,
    CHATML_END,
    CHATML_START,
    CONTROL,
    NORMAL,
    UNIGRAM,
    UNKNOWN,
    USER_DEFINED,
    SentencePieceModel,
    id_to_token,
    read_sentencepiece,
)

if TYPE_CHECKING:
    from megacore.artifacts.manifest import CheckpointManifest, TokenizerInfo, TrainedTokenizer
    from megacore.config import ModelConfig

SPACE = "\u2581"  # sentencepiece's escaped space


def _normalizer(m: SentencePieceModel) -> dict | None:
    steps: list[dict] = []
    if m.charsmap:
        steps.append({"type": "Precompiled", "precompiled_charsmap": base64.b64encode(m.charsmap).decode()})
    if m.remove_extra_whitespaces:
        steps += _remove_extra_whitespaces(m)
    if m.add_dummy_prefix:
        steps.append({"type": "Prepend", "prepend": SPACE})  # not to an empty text, like sentencepiece
    if m.escape_whitespaces:
        steps.append(_replace(" ", SPACE))
    return {"type": "Sequence", "normalizers": steps} if steps else None


# Rust's char::is_whitespace but the space: what a Strip normalizer removes besides it, in tokenizers
# and gigatoken alike.
_OTHER_WHITESPACE = (
    "\t\n\x0b\x0c\r\x85\xa0\u1680"
    + "".join(map(chr, range(0x2000, 0x200B)))
    + "\u2028\u2029\u202f\u205f\u3000"
)
_STAND_INS = "".join(map(chr, range(0xFF01, 0xFF5F)))  # fullwidth ASCII: NFKC-based maps rewrite it


def _remove_extra_whitespaces(m: SentencePieceModel) -> list[dict]:
    """Spaces (U+0020 only) dropped at both ends of the mapped text and runs of them collapsed;
    sentencepiece trims the end after escaping, so a literal U+2581 there goes too.

    gigatoken reads `Strip` and the regex " {2,}" but no other regex, and `Strip` removes every
    Unicode whitespace: so each other whitespace character the map can output stands in, while
    `Strip` runs, as a character the map never outputs. A map with no such characters to spare (or
    no map): anchored regexes, which only `tokenizers` reads."""
    cmap = _CharsMap(m.charsmap) if m.charsmap else None
    other = [c for c in _OTHER_WHITESPACE if cmap is None or cmap.can_output(c)]
    bar = m.escape_whitespaces and (cmap is None or cmap.can_output(SPACE))
    stand_ins = [c for c in _STAND_INS if not cmap.can_output(c)] if cmap else []
    collapse = _replace(" {2,}", " ", regex=True)
    if len(stand_ins) < len(other):  # \A, \z: ^ and $ match at line breaks in Oniguruma
        return [_replace(f"\\A +|[ {SPACE}]+\\z" if bar else "\\A +| +\\z", "", regex=True), collapse]
    hide = [_replace(w, s) for w, s in zip(other, stand_ins, strict=False)]
    show = [_replace(s, w) for w, s in zip(other, stand_ins, strict=False)]
    strip = [{"type": "Strip", "strip_left": True, "strip_right": not bar}]
    if bar:  # U+2581 as whitespace for the end's strip only (any U+3000 is hidden by then)
        strip += [_replace(SPACE, "\u3000"), {"type": "Strip", "strip_left": False, "strip_right": True}]
        strip += [_replace("\u3000", SPACE)]
    return hide + strip + [collapse] + show


def _replace(pattern: str, content: str, regex: bool = False) -> dict:
    return {"type": "Replace", "pattern": {"Regex" if regex else "String": pattern}, "content": content}


class _CharsMap:
    """Which characters a precompiled character map can output: its replacements' and those that
    are not a key on their own (a double-array trie over UTF-8 keys, as sentencepiece stores it)."""

    def __init__(self, charsmap: bytes) -> None:
        (size,) = struct.unpack_from("<I", charsmap)
        self.units = struct.unpack_from(f"<{size // 4}I", charsmap, 4)
        self.replaced_by = set(charsmap[4 + size :].decode("utf-8", errors="replace"))

    def can_output(self, c: str) -> bool:
        return c in self.replaced_by or not self._is_key(c)

    def _is_key(self, c: str) -> bool:
        def offset(unit: int) -> int:
            return (unit >> 10) << ((unit & (1 << 9)) >> 6)

        unit = self.units[0]
        pos = offset(unit)
        for b in c.encode():
            pos ^= b
            if pos >= len(self.units):
                return False
            unit = self.units[pos]
            if unit & ((1 << 31) | 0xFF) != b:  # the unit's label
                return False
            pos ^= offset(unit)
        return bool(unit & (1 << 8))  # has a leaf: a key ends here


def _bpe_merges(m: SentencePieceModel) -> list[list[str]]:
    """Every split of every mergeable piece into two pieces that can occur, the highest-scoring
    merged piece first (ties: the lower id, sentencepiece's order)."""
    symbols = {p for p, _, t in m.pieces if t == NORMAL}
    ranked = sorted(
        ((-score, i, p) for i, (p, score, t) in enumerate(m.pieces) if t == NORMAL and len(p) > 1),
    )
    merges = []
    for _, _, piece in ranked:
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in symbols and right in symbols:
                merges.append([left, right])
    return merges


def sentencepiece_tokenizer_json(raw: bytes, added: dict[str, int] | None = None) -> dict:
    """The `tokenizer.json` (as a dict) of a `.model`'s bytes; `added`: special tokens added past
    its vocab (`TokenizerInfo.added_special_tokens`, e.g. ChatML markers), by id."""
    m = read_sentencepiece(raw)
    if m.treat_whitespace_as_suffix:
        raise ValueError("models that treat whitespace as a suffix are not supported")
    if m.model_type != BPE:
        kind = "a unigram" if m.model_type == UNIGRAM else f"a type-{m.model_type}"
        raise ValueError(
            f"{kind} SentencePiece model has no tokenizer.json that encodes exactly like it (BPE only)"
        )
    if any(t == USER_DEFINED for _, _, t in m.pieces):
        # sentencepiece matches them anywhere in the normalized text; tokenizers normalizes an added
        # token's text too, dummy prefix included, so it would match "foo" only as "▁foo".
        raise ValueError(
            "a SentencePiece model with user-defined pieces has no tokenizer.json that encodes exactly like it"
        )
    unk = m.pieces[m.unk_id][0] if 0 <= m.unk_id < len(m.pieces) else None
    model = {
        "type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
        "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": m.byte_fallback,
        "ignore_merges": False, "vocab": {p: i for i, (p, _, _) in enumerate(m.pieces)},
        "merges": _bpe_merges(m),
    }  # fmt: skip
    special = [(i, p) for i, (p, _, t) in enumerate(m.pieces) if t in (CONTROL, UNKNOWN)]
    added_tokens = [_added(i, p, special=True) for i, p in special]
    added_tokens += [_added(i, p, special=True) for p, i in sorted((added or {}).items(), key=lambda x: x[1])]
    strip_prefix = 1 if m.add_dummy_prefix else 0
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": _normalizer(m),
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": strip_prefix, "stop": 0},
            ],
        },
        "model": model,
    }


def _added(i: int, content: str, special: bool) -> dict:
    return {
        "id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
        "normalized": not special, "special": special,
    }  # fmt: skip


# mega-tokenize's ChatML rendering (`<|im_start|>role\ncontent<|im_end|>\n` per message), as a template.
CHATML_TEMPLATE = (
    f"{{% for message in messages %}}{{{{ '{CHATML_START}' + message['role'] + '\\n' + message['content'] + "
    f"'{CHATML_END}' + '\\n' }}}}{{% endfor %}}{{% if add_generation_prompt %}}{{{{ '{CHATML_START}assistant\\n' }}}}"
    "{% endif %}"
)


def hf_tokenizer_files(
    root: Path, tokenizer: TrainedTokenizer, vocab_rows: int, max_len: int
) -> dict[str, str]:
    """The files (name -> text) of a Hugging Face tokenizer for `tokenizer`, whose files are
    relative to `root`: tokenizer.json, tokenizer_config.json and generation_config.json.

    `vocab_rows`: the model's vocab size; every id the tokenizer can produce must have a row."""
    info = tokenizer.info
    data, source_config = _source_tokenizer(root, info)
    names = id_to_token(data)
    top = max(names)
    if top >= vocab_rows:
        raise ValueError(
            f"the tokenizer has ids up to {top} and the model {vocab_rows} embedding rows: ids "
            f"{vocab_rows}..{top} would have no embedding"
        )

    def token(i: int | None) -> str | None:
        return names.get(i) if i is not None else None

    chatml = tokenizer.chat_template == "chatml"
    # Data rendered with the tokenizer's own template was encoded as the template says (BOS and all):
    # plain `tokenizer(text)` stays the source's, its post-processor's BOS included (Llama 3, Gemma 3;
    # transformers reads `add_bos_token` only without a tokenizer.json).
    if not (tokenizer.chat_template and not chatml and info.type == "hf"):
        _post_processor(data, token(info.bos_id) if tokenizer.prepend_bos else None, info.bos_id)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # tokenizer.json as written, nothing rebuilt
        "bos_token": token(info.bos_id),
        "eos_token": token(info.eos_id),
        "unk_token": token(info.unk_id),
        "pad_token": token(info.pad_id),
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
    }
    template = CHATML_TEMPLATE if chatml else tokenizer.chat_template or source_config.get("chat_template")
    if template:
        config["chat_template"] = template
    stops = _stop_ids(tokenizer, names, source_config)
    generation = {"bos_token_id": info.bos_id, "eos_token_id": stops[0] if len(stops) == 1 else stops or None}
    if info.pad_id is not None:
        generation["pad_token_id"] = info.pad_id
    return {
        "tokenizer.json": json.dumps(data, ensure_ascii=False),
        "tokenizer_config.json": _pretty({k: v for k, v in config.items() if v is not None}),
        "generation_config.json": _pretty(generation),
    }


def checkpoint_tokenizer_files(
    root: Path, manifest: CheckpointManifest, config: ModelConfig
) -> dict[str, bytes]:
    """A checkpoint's tokenizer as Hugging Face files (name -> bytes), what mega-export writes: a
    trained checkpoint's from its data's tokenizer (`hf_tokenizer_files`), a converted one's own
    files as they were. ValueError: a `.model` no tokenizer.json encodes alike, ids past the rows."""
    if manifest.tokenizer is not None:
        return trained_tokenizer_files(root, manifest.tokenizer, config)
    return {Path(rel).name: (root / rel).read_bytes() for rel in manifest.tokenizer_files}


def trained_tokenizer_files(root: Path, tokenizer: TrainedTokenizer, config: ModelConfig) -> dict[str, bytes]:
    """`hf_tokenizer_files` for a model of `config` (its rows, its context), as bytes."""
    made = hf_tokenizer_files(root, tokenizer, config.vocab_size, config.max_seq_len)
    return {name: text.encode("utf-8") for name, text in made.items()}


def load_tokenizer(files: dict[str, bytes]):
    """transformers' tokenizer of Hugging Face tokenizer `files` (name -> bytes), through a
    directory: transformers 5 builds an empty tokenizer from some files given one by one."""
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        return AutoTokenizer.from_pretrained(tmp)


def _source_tokenizer(root: Path, info: TokenizerInfo) -> tuple[dict, dict]:
    """(tokenizer.json's content, the source's tokenizer_config.json or {}): a SentencePiece model
    converted, a Hugging Face tokenizer's own with the tokens added at tokenize time appended."""
    files = {Path(rel).name: root / rel for rel in info.files}
    if info.type == "sentencepiece":
        model = next(path for name, path in files.items() if name.endswith(".model"))
        return sentencepiece_tokenizer_json(model.read_bytes(), info.added_special_tokens), {}
    data = json.loads(files["tokenizer.json"].read_text(encoding="utf-8"))
    source_config: dict = {}
    if "tokenizer_config.json" in files:
        source_config = json.loads(files["tokenizer_config.json"].read_text(encoding="utf-8"))
    have = {t["content"] for t in data.get("added_tokens", [])}
    data["added_tokens"] = data.get("added_tokens", []) + [
        _added(i, name, special=True)
        for name, i in sorted(info.added_special_tokens.items(), key=lambda kv: kv[1])
        if name not in have
    ]
    return data, source_config


def _post_processor(data: dict, bos: str | None, bos_id: int | None) -> None:
    """Encoding adds what the training data had: a BOS when it was prepended, else nothing."""
    if bos is not None:
        data["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
        }  # fmt: skip
    elif (data.get("post_processor") or {}).get("type") != "ByteLevel":  # offsets only: kept
        data["post_processor"] = None


def _stop_ids(tokenizer: TrainedTokenizer, names: dict[int, str], source_config: dict) -> list[int]:
    """Where generation stops: at every id the source tokenizer's generation_config.json named, in
    its order (so the export's list is the original's), at EOS, and at the end of a turn."""
    info = tokenizer.info
    stops = list(info.stop_ids)
    if info.eos_id is not None and info.eos_id not in stops:
        stops.append(info.eos_id)
    ends: dict[str, int | None] = {}
    if tokenizer.chat_template == "chatml":
        ends[CHATML_END] = info.added_special_tokens.get(CHATML_END)
    elif tokenizer.chat_template:
        eos = source_config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            ends[eos] = None
    for name, i in ends.items():
        i = i if i is not None else next((k for k, v in names.items() if v == name), None)
        if i is not None and i not in stops:
            stops.append(i)
    return stops


def _pretty(data: dict) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"
