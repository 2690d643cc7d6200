"""Tokenizers and encoding engines.

A tokenizer is a SentencePiece `.model` or a Hugging Face `tokenizer.json` (or a directory with
one). Its *reference* encoder defines the ids: sentencepiece itself for a `.model`, the
`tokenizers` library for a `tokenizer.json`. Engines are faster encoders of the same tokenizer;
one is used only when it gives the reference's ids (checked on samples, see `verify_engine`).

A `.model` reaches the `hf` and `gigatoken` engines as the tokenizer.json mega-export writes for it
(megacore.models.hf_tokenizer): one conversion, so the ids written here are the exported
tokenizer's. gigatoken cannot read that file for some models (no byte fallback; extra-whitespace
removal without a character map) and no file exists for others (unigram, user-defined pieces):
`auto` then encodes with sentencepiece.

Raw text never produces control tokens: a literal "<s>" in a document stays the text "<s>", the way
sentencepiece treats it. The HF and gigatoken paths would match it as the control token, so they
are built with the special tokens removed from text matching, and every batch is checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import numpy as np

from megacore import env
from megacore.errors import UserError

EngineName = Literal["auto", "sentencepiece", "hf", "gigatoken"]
ENGINES: tuple[str, ...] = ("sentencepiece", "hf", "gigatoken")

# Texts that trip converted tokenizers: control-token lookalikes, whitespace runs, byte fallback.
PROBES = [
    "<s> literal </s> tags <unk> stay text <|endoftext|> <|im_start|>user<|im_end|> [INST] x [/INST]",
    "  leading and   inner  spaces\t\ttabs\n\nnewlines  ",
    "def f(x):\n    return {'a': [1, 2]}  # comment\n\n\n        deeply indented",
    "émigré naïve café, Ünïcödé — “quotes” ‘single’ … ½ ≠ ∞",
    "漢字かなカナ 한국어 中文文本 العربية עברית हिन्दी ไทย",
    "emoji 😀🤖👍🏽 zwj 👨‍👩‍👧 flags 🇫🇷 \u200b\u00a0nbsp\ufeffbom",
    "\x00\x01\x7f control chars \u2028 \u2029 separators \r\n crlf",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "1234567890 3.14159 -2e10 0x1F 1,000,000",
    " ",
    "x",
]


class Engine(Protocol):
    name: str
    # How many batches the pipeline encodes at once: `--workers` when each call runs on the
    # calling thread (gigatoken), else 2 (calls fan out to the engine's own threads; a second one
    # keeps them busy during the first one's tail).
    concurrency: int

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of every text back to back (uint32) and each text's count (int64)."""
        ...


def _flatten(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    from itertools import chain

    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    flat = np.fromiter(chain.from_iterable(lists), dtype=np.uint32, count=int(lengths.sum()))
    return flat, lengths


@dataclass
class Tokenizer:
    """A loaded tokenizer: where its files are, its ids, and how to build engines for it."""

    type: Literal["sentencepiece", "hf"]
    path: Path
    files: list[Path]
    base_vocab_size: int
    special_tokens: dict[str, int]  # control/special tokens text must never produce
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    unk_id: int | None = None
    added: dict[str, int] = field(default_factory=dict)  # --add-special-tokens, in order
    chat_template: str | None = None
    stop_ids: list[int] = field(default_factory=list)  # generation_config.json's eos ids
    threads: int = 1

    @property
    def vocab_size(self) -> int:
        return max(self.base_vocab_size, self._top)

    _top: int = 0  # one past the largest added id

    def fingerprint(self) -> str:
        """sha256 over the tokenizer's file names and contents: the same files, the same ids."""
        h = hashlib.sha256()
        for f in sorted(self.files, key=lambda p: p.name):
            h.update(f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
        return h.hexdigest()

    def token_id(self, token: str) -> int | None:
        """The id of a whole token (special, control or an exact vocab piece), or None."""
        if token in self.added:
            return self.added[token]
        if token in self.special_tokens:
            return self.special_tokens[token]
        if self.type == "sentencepiece":
            sp = self._sp()
            i = sp.piece_to_id(token)
            return i if sp.id_to_piece(i) == token and not sp.is_unknown(i) else None
        return self._hf().token_to_id(token)

    def add_special_tokens(self, tokens: list[str]) -> dict[str, int]:
        """Give each token an id: its existing one, else the next free id after the vocab."""
        for t in tokens:
            if not t:
                raise UserError("--add-special-tokens: empty token")
            existing = self.token_id(t)
            self.added[t] = existing if existing is not None else self.vocab_size
            self._top = max(self._top, self.added[t] + 1)
        return dict(self.added)

    # --- reference encoders ------------------------------------------------------------------

    def _sp(self):
        if not hasattr(self, "_sp_proc"):
            import sentencepiece as spm

            self._sp_proc = spm.SentencePieceProcessor(model_file=str(self.path))
        return self._sp_proc

    def _hf(self):
        if not hasattr(self, "_hf_tok"):
            import tokenizers

            if self.type == "hf":
                tok = tokenizers.Tokenizer.from_file(str(self.path))
            else:  # a .model through the sentencepiece-faithful tokenizer.json (not transformers')
                tok = tokenizers.Tokenizer.from_str(self.tokenizer_json(strip_special=False))
            tok.no_truncation()
            tok.no_padding()
            # Special tokens in raw text are encoded as text, like sentencepiece does.
            tok.encode_special_tokens = True
            self._hf_tok = tok
        return self._hf_tok

    def tokenizer_json(self, strip_special: bool) -> str:
        """tokenizer.json text for the HF-style engines; `strip_special` drops the special tokens
        from text matching (they stay in the vocab), so raw text cannot produce them."""
        if self.type == "sentencepiece":

            def convert(raw: bytes) -> str:
                # The exported tokenizer's converter (mega-export writes the same file). Imported
                # here: megacore.models imports torch, paid only when the cache misses.
                from megacore.models.hf_tokenizer import sentencepiece_tokenizer_json

                data = sentencepiece_tokenizer_json(raw)
                return _strip(data) if strip_special else json.dumps(data, ensure_ascii=False)

            return _cached(self.path, f"spm-{'strip' if strip_special else 'full'}", convert)
        text = self.path.read_text(encoding="utf-8")
        return _strip(json.loads(text)) if strip_special else text

    def engine(self, name: str) -> Engine:
        if name == "sentencepiece":
            if self.type != "sentencepiece":
                raise UserError("--engine sentencepiece needs a SentencePiece .model tokenizer")
            return _SentencePieceEngine(self._sp(), self.threads)
        if name == "hf":
            return _HFEngine(self._hf(), self.threads)
        if name == "gigatoken":
            return _GigatokenEngine(self, self.threads)
        raise UserError(f"unknown engine {name!r}; choose one of auto, {', '.join(ENGINES)}")

    def reference(self) -> Engine:
        return self.engine("sentencepiece" if self.type == "sentencepiece" else "hf")

    def check_no_special(self, flat: np.ndarray) -> None:
        """Raise if raw text produced a control/special token (a broken engine, never data)."""
        if not self.special_tokens or not len(flat):
            return
        ids = np.fromiter(self.special_tokens.values(), dtype=np.int64)
        lo, hi = int(ids.min()), int(ids.max())
        if hi - lo + 1 == len(ids):  # a contiguous range (sentencepiece's 1, 2): two compares
            bad = (flat >= lo) & (flat <= hi)
        else:
            lut = np.zeros(max(self.vocab_size, hi + 1, int(flat.max()) + 1), dtype=bool)
            lut[ids] = True
            bad = lut[flat]
        if bad.any():
            tid = int(flat[np.argmax(bad)])
            raise RuntimeError(
                f"the engine produced control token id {tid} from raw text; use --engine {self.reference().name}"
            )


def _strip(data: dict) -> str:
    data["added_tokens"] = [t for t in data.get("added_tokens", []) if not t.get("special")]
    return json.dumps(data, ensure_ascii=False)


def _cached(path: Path, kind: str, convert) -> str:
    """convert(file bytes), cached by content and converter: converting a 32k .model takes a
    second, importing the converter (megacore.models: torch) a few more."""
    raw = path.read_bytes()
    root = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mega-tokenize"
    try:
        cached = root / f"{kind}-{hashlib.sha256(raw + _converter_source()).hexdigest()[:32]}.json"
    except OSError:  # the converter's source unreadable: no cache
        cached = None
    try:
        if cached is not None:
            return cached.read_text(encoding="utf-8")
    except OSError:
        pass
    try:
        text = convert(raw)
    except ValueError as e:  # unigram models etc.: only sentencepiece itself reads them
        raise RuntimeError(f"this .model cannot be converted: {e}") from None
    try:
        if cached is not None:
            root.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, cached)
    except OSError:
        pass  # a read-only home: convert again next time
    return text


def _converter_source() -> bytes:
    """megacore's converter modules, read without importing them: a changed converter never meets
    an old cache entry."""
    import megacore

    root = Path(megacore.__file__).parent
    return b"".join((root / rel).read_bytes() for rel in ("models/hf_tokenizer.py", "tokenizer_files.py"))


class _SentencePieceEngine:
    name = "sentencepiece"
    concurrency = 2

    def __init__(self, sp, threads: int) -> None:
        self.sp, self.threads = sp, threads

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        return _flatten(self.sp.encode(texts, out_type=int, num_threads=self.threads))


class _HFEngine:
    name = "hf"
    concurrency = 2

    def __init__(self, tok, threads: int) -> None:
        self.tok, self.threads = tok, threads

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        encs = self.tok.encode_batch_fast(texts, add_special_tokens=False)
        return _flatten([e.ids for e in encs])


class _GigatokenEngine:
    name = "gigatoken"

    def __init__(self, tokenizer: Tokenizer, threads: int) -> None:
        try:
            import gigatoken
        except ImportError as e:
            raise UserError(
                "--engine gigatoken needs the optional extra: pip install 'mega-tokenize[fast]'"
            ) from e
        # Special tokens are stripped from text matching: raw text stays text.
        text = tokenizer.tokenizer_json(strip_special=True)
        try:
            self.tok = gigatoken.Tokenizer.from_json(text)
        except Exception as e:  # a normalizer or pre-tokenizer it does not implement
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RuntimeError(f"gigatoken cannot load this tokenizer ({reason})") from None
        # Each call encodes its whole batch on the calling thread (GIL released) and the pipeline
        # runs `threads` calls at once. parallel=True would cut a batch of a few MB into 1 MB
        # rayon chunks, each starting with a cold pretoken cache: ~25% more CPU for the same ids.
        self.concurrency = max(1, threads)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        arr = self.tok.encode_batch(texts, parallel=False)
        offsets = np.asarray(arr.layout.offsets)
        flat = np.asarray(arr.layout.content.data)[offsets[0] : offsets[-1]]
        return flat, np.diff(offsets)


def set_threads(n: int) -> None:
    """Size the Rust thread pools of tokenizers/gigatoken before their first use (later: no effect)."""
    env.set_for_libraries("RAYON_NUM_THREADS", str(n))
    env.set_for_libraries("RAYON_RS_NUM_CPUS", str(n))
    env.set_for_libraries("TOKENIZERS_PARALLELISM", "true" if n > 1 else "false", override=True)


def load_tokenizer(path: Path, threads: int = 1) -> Tokenizer:
    """Load a SentencePiece `.model`, a `tokenizer.json` or a tokenizer directory."""
    path = Path(path)
    if not path.exists():
        raise UserError("no such tokenizer file or directory", str(path))
    if path.is_dir():
        tj, model = path / "tokenizer.json", path / "tokenizer.model"
        if tj.is_file():
            tok = _load_hf(tj, threads)
        elif model.is_file():
            tok = _load_sp(model, threads)
        else:
            raise UserError("no tokenizer.json or tokenizer.model in this directory", str(path))
        cfg = path / "tokenizer_config.json"
        if cfg.is_file():
            tok.files.append(cfg)
            _apply_config(tok, cfg)
        for extra in ("special_tokens_map.json", "chat_template.jinja"):
            if (path / extra).is_file():
                tok.files.append(path / extra)
                if extra.endswith(".jinja") and tok.chat_template is None:
                    tok.chat_template = (path / extra).read_text(encoding="utf-8")
        if (path / "generation_config.json").is_file():
            tok.stop_ids = _stop_ids(path / "generation_config.json")
        return tok
    if path.suffix == ".json":
        return _load_hf(path, threads)
    return _load_sp(path, threads)


def _load_sp(path: Path, threads: int) -> Tokenizer:
    import sentencepiece as spm

    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as e:
        reason = str(e).split(":")[0]
        raise UserError(
            f"not a SentencePiece model ({reason}); give a .model, a tokenizer.json or a tokenizer directory",
            str(path),
        ) from None
    special = {sp.id_to_piece(i): i for i in range(sp.vocab_size()) if sp.is_control(i)}

    def opt(i: int) -> int | None:
        return i if i >= 0 else None

    tok = Tokenizer(
        type="sentencepiece",
        path=path,
        files=[path],
        base_vocab_size=sp.vocab_size(),
        special_tokens=special,
        bos_id=opt(sp.bos_id()),
        eos_id=opt(sp.eos_id()),
        pad_id=opt(sp.pad_id()),
        unk_id=opt(sp.unk_id()),
        threads=threads,
    )
    tok._sp_proc = sp
    return tok


_BOS_GUESSES = ("<s>", "<|begin_of_text|>", "<bos>", "[BOS]")
_EOS_GUESSES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "[EOS]")


def _load_hf(path: Path, threads: int) -> Tokenizer:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or "model" not in data:
            raise ValueError("no 'model' section")
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"not a Hugging Face tokenizer.json ({e})", str(path)) from None
    special = {t["content"]: int(t["id"]) for t in data.get("added_tokens", []) if t.get("special")}
    tok = Tokenizer(
        type="hf", path=path, files=[path], base_vocab_size=0, special_tokens=special, threads=threads
    )
    try:
        tok.base_vocab_size = tok._hf().get_vocab_size(with_added_tokens=True)
    except Exception as e:
        raise UserError(f"the tokenizers library cannot load it ({e})", str(path)) from None
    tok.bos_id = next((special[t] for t in _BOS_GUESSES if t in special), None)
    tok.eos_id = next((special[t] for t in _EOS_GUESSES if t in special), None)
    unk = (data.get("model") or {}).get("unk_token")
    tok.unk_id = tok._hf().token_to_id(unk) if unk else None
    return tok


def _apply_config(tok: Tokenizer, cfg: Path) -> None:
    """bos/eos/pad and the chat template from tokenizer_config.json, where it names them."""
    try:
        conf = json.loads(cfg.read_text(encoding="utf-8"))
    except ValueError as e:
        raise UserError(f"not valid JSON ({e})", str(cfg)) from None

    def ident(key: str) -> int | None:
        v = conf.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return tok.token_id(v) if isinstance(v, str) else None

    tok.bos_id = ident("bos_token") if ident("bos_token") is not None else tok.bos_id
    tok.eos_id = ident("eos_token") if ident("eos_token") is not None else tok.eos_id
    tok.pad_id = ident("pad_token") if ident("pad_token") is not None else tok.pad_id
    tmpl = conf.get("chat_template")
    if isinstance(tmpl, list):  # named templates: take "default"
        tmpl = next((t.get("template") for t in tmpl if t.get("name") == "default"), None)
    if isinstance(tmpl, str):
        tok.chat_template = tmpl


def _stop_ids(path: Path) -> list[int]:
    """generation_config.json's `eos_token_id`: one id or several."""
    try:
        ids = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (ValueError, UnicodeDecodeError, AttributeError) as e:
        raise UserError(f"not a JSON object ({e})", str(path)) from None
    ids = [ids] if isinstance(ids, int) else ids
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    ):
        raise UserError(f"eos_token_id: expected an id or a list of ids, got {ids!r}", str(path))
    return list(dict.fromkeys(ids))


# --- engine choice -------------------------------------------------------------------------------


def _agree(a: Engine, b: Engine, texts: list[str]) -> int | None:
    """Index of the first text on which the two engines differ, or None."""
    fa, la = a.encode(texts)
    fb, lb = b.encode(texts)
    if np.array_equal(la, lb) and np.array_equal(fa, fb):
        return None
    oa, ob = np.concatenate([[0], np.cumsum(la)]), np.concatenate([[0], np.cumsum(lb)])
    for i in range(len(texts)):
        if not np.array_equal(fa[oa[i] : oa[i + 1]], fb[ob[i] : ob[i + 1]]):
            return i
    return 0


def candidate_engine(tok: Tokenizer, requested: str, log=None) -> Engine:
    """The engine to start with: the one named, or for `auto` the fastest one that loads
    (gigatoken, else the reference). Its ids are then checked with `verify_engine`."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if requested != "auto":
        return tok.engine(requested)
    try:
        return tok.engine("gigatoken")
    except (UserError, RuntimeError) as e:
        log(f"mega-tokenize: engine gigatoken not used: {e}")
        return tok.reference()


def verify_engine(tok: Tokenizer, eng: Engine, sample: list[str], probes: bool = True) -> str | None:
    """None when `eng` gives the reference's ids on the sample (and, with `probes`, the built-in
    tricky texts), else what differs."""
    ref = tok.reference()
    if eng.name == ref.name:
        return None
    texts = (PROBES if probes else []) + [t for t in sample if t]
    if not texts:
        return None
    bad = _agree(eng, ref, texts)
    if bad is None:
        return None
    return f"engine {eng.name} gives different ids than {ref.name} on {texts[bad][:60]!r}"
