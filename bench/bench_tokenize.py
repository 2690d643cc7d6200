"""mega-tokenize against Megatron-LM's `tools/preprocess_data.py` (and a look-alike of it), side by side.

Corpus: real text found on this machine (the Python standard library's sources, then the text of
/usr/share/doc, then the .py files of the venv's packages) as jsonl, one file per document, at
least 200 MB (`--quick`: 8 MB). Built once, cached in bench-out/ (git-ignored): benchlib's
`tokenize_inputs`.

Measured in one run, same corpus, same tokenizer (the real 32k SentencePiece model in
../shared/assets, else a model trained here), 2 workers:
- baseline: megatron-core's `IndexedDatasetBuilder` driven the way preprocess_data.py drives it:
  `multiprocessing.Pool(2).imap(encode, lines, 32)`, json.loads + sentencepiece per line, one
  `add_document` per document in the main process.
- ours: mega-tokenize's library call (what the command runs), `--workers 2`, in this process like
  the baseline: imports done, but its tokenizer and engine built in every run, as the baseline
  builds its own. Twice: `--engine auto` (the default, the fastest engine that gives
  sentencepiece's ids) and `--engine sentencepiece`, the baseline's own engine, so the pipeline's
  gain shows apart from the engine's. The command itself (interpreter start and imports included)
  is timed too and reported on its own row.
- bare engine: the engine mega-tokenize chose, encoding the already-parsed texts in memory with 2
  threads, and gigatoken's own `encode_files` (reads and parses the jsonl itself, tokenizer built
  before the clock starts): the floor no pipeline can beat.
- a Megatron-style gigatoken fast path: gigatoken's own jsonl reader and encoder, the builder
  adding one document at a time (and the literal-"<s>" trap it falls into).
- Megatron-LM itself, when MEGATRON_LM names a Megatron-LM checkout: its `tools/preprocess_data.py`
  (`--tokenizer-type GPTSentencePieceTokenizer`, else `SentencePieceTokenizer`, whichever the
  checkout offers, `--workers 2 --append-eod`) and, where the checkout has it,
  `tools/preprocess_data_fast.py` (gigatoken: `--tokenizer-type HuggingFaceTokenizer
  --use-gigatoken` on a tokenizer.json converted from the same .model), each as a whole command
  (`PYTHONPATH=$MEGATRON_LM`, interpreter MEGATRON_PYTHON or this one), next to the
  `mega-tokenize` command with either engine. Its dependencies beyond megatron-core (six, triton,
  ...; Python >= 3.12 from core_v0.17 on) must be importable by that interpreter; a checkout that
  cannot run shows its error in the row's note.
Timing: every timed path runs once to warm up, then ROUNDS rounds in which each runs once, the
order rotated every round (benchlib's `paired_rounds`), on the same page-cached corpus. Ratios are
the median over rounds of peer time / ours in the same round (the machine is shared: its speed
drifts within minutes); the times shown are each path's best.
Agreement (checked, the run exits 1 when one fails): ours against sentencepiece on every document,
and our shards against the baseline's and Megatron-LM's: the .bin ids and the .idx (dtype,
sequence lengths, sequence pointers, document indices).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchlib import OUT as BENCH_OUT
from benchlib import (
    THREADS,
    TOKENIZE_ENV,
    launch,
    median_ratio,
    paired_rounds,
    tokenize_command,
    tokenize_inputs,
)
from run import Row

OUT = BENCH_OUT / "tokenize"
ROUNDS = 5  # paired rounds after the warm-up (--quick: QUICK_ROUNDS)
QUICK_ROUNDS = 3
ENABLE = "MEGATRON_LM=/path/to/Megatron-LM (a checkout) to run its tools/preprocess_data.py"


# --- the Megatron-LM baseline (tools/preprocess_data.py's structure) ------------------------------


class _Encoder:
    def __init__(self, model: str) -> None:
        self.model = model

    def initializer(self) -> None:
        import sentencepiece as spm

        _Encoder.sp = spm.SentencePieceProcessor(model_file=self.model)

    def encode(self, line: str):
        data = json.loads(line)
        ids = _Encoder.sp.encode_as_ids(data["text"])
        if len(ids) > 0:
            ids.append(_Encoder.sp.eos_id())
        return {"text": ids}, {"text": [len(ids)]}, len(line)


def megatron_baseline(corpus: Path, model: Path, prefix: Path) -> float:
    import sentencepiece as spm
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    vocab = spm.SentencePieceProcessor(model_file=str(model)).vocab_size()
    t0 = time.perf_counter()
    encoder = _Encoder(str(model))
    with open(corpus, encoding="utf-8") as fin:
        pool = multiprocessing.get_context("fork").Pool(THREADS, initializer=encoder.initializer)
        encoded = pool.imap(encoder.encode, fin, 32)
        builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(vocab))
        for doc, lengths, _ in encoded:
            builder.add_document(torch.IntTensor(doc["text"]), lengths["text"])
        builder.finalize(f"{prefix}.idx")
        pool.close()
        pool.join()
    return time.perf_counter() - t0


def megatron_gigatoken_path(corpus: Path, model: Path, prefix: Path) -> float:
    """A preprocess_data-style fast path: gigatoken encodes the jsonl files itself (2 threads),
    the builder adds one document at a time. The plain `Tokenizer.from_sentencepiece` is used, as
    such a path would: it turns a literal "<s>" in the text into the control token."""
    import gigatoken
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    t0 = time.perf_counter()
    tok = gigatoken.Tokenizer.from_sentencepiece(model)
    docs = tok.encode_files(gigatoken.JsonlFileSource([str(corpus)], field="text"), parallel=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(tok.vocab_size))
    eos = 2
    for ids in docs:
        arr = np.asarray(ids)
        builder.add_document(torch.from_numpy(np.append(arr, eos).astype(np.int64)), [len(arr) + 1])
    builder.finalize(f"{prefix}.idx")
    return time.perf_counter() - t0


# --- Megatron-LM's own tools, as commands (MEGATRON_LM) -----------------------------------------


class PeerFailed(RuntimeError):
    """A peer command that could not run here: the message goes into the row's note."""


def _megatron_python() -> str:
    return os.environ.get("MEGATRON_PYTHON") or sys.executable


def _megatron_env(checkout: Path) -> dict[str, str]:
    """Subprocesses get the thread settings the in-process paths run under."""
    path = os.pathsep.join(p for p in (str(checkout), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, **TOKENIZE_ENV, "PYTHONPATH": path}


def _checkout_text(checkout: Path, *globs: str) -> str:
    return "\n".join(p.read_text(errors="replace") for g in globs for p in sorted(checkout.glob(g)))


def megatron_sp_type(checkout: Path) -> str:
    """The checkout's tokenizer type for a SentencePiece .model: GPTSentencePieceTokenizer (plain
    sentencepiece ids, eod = the model's eos) where it has it, else SentencePieceTokenizer."""
    args = _checkout_text(checkout, "megatron/training/arguments.py", "megatron/training/config/*.py")
    for name in ("GPTSentencePieceTokenizer", "SentencePieceTokenizer"):
        if f"'{name}'" in args or f'"{name}"' in args:
            return name
    raise PeerFailed("its megatron/training arguments offer no SentencePiece tokenizer type")


def hf_tokenizer_dir(model: Path) -> Path:
    """A Hugging Face tokenizer directory for the same .model (what preprocess_data_fast.py loads):
    mega-tokenize's sentencepiece-faithful tokenizer.json, special tokens included as a model
    repository ships them."""
    from mega_tokenize.tokenizer import load_tokenizer

    out = OUT / "hf-tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(model)
    (out / "tokenizer.json").write_text(tok.tokenizer_json(strip_special=False), encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    config["unk_token"] = "<unk>"
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return out


def _why(stderr: str, checkout: Path) -> str:
    """The exception line of a failed Megatron command, plus what to do when it is the Python."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b", ln)]
    why = (errors or lines or ["no output"])[-1][:200]
    try:
        import tomllib

        from packaging.specifiers import SpecifierSet

        need = tomllib.loads((checkout / "pyproject.toml").read_text())["project"]["requires-python"]
        ver = subprocess.run(
            [_megatron_python(), "-c", "import platform; print(platform.python_version())"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        if ver and ver not in SpecifierSet(need):
            why += f" (this checkout needs Python {need}, {_megatron_python()} is {ver}: set MEGATRON_PYTHON)"
    except Exception:  # no pyproject / no packaging: the error line alone
        pass
    return why


def megatron_command(checkout: Path, script: str, args: list[str], timeout: float) -> float:
    """Wall seconds of `python tools/<script> ARGS` run from the checkout (PYTHONPATH=checkout)."""
    cmd = [_megatron_python(), checkout / "tools" / script, *args]
    child = launch(cmd, env=_megatron_env(checkout), timeout=timeout)
    if child.timed_out:
        raise PeerFailed(f"{script} ran past {timeout:.0f}s")
    if child.code != 0:
        raise PeerFailed(f"{script} exited {child.code}: {_why(child.stderr, checkout)}")
    return child.seconds


def megatron_prefix(prefix: Path) -> Path:
    """Where preprocess_data*.py put the shard of key "text" for `--output-prefix prefix`."""
    return Path(f"{prefix}_text_document")


# --- ours ---------------------------------------------------------------------------------------


def ours(corpus: Path, model: Path, out: Path, engine: str = "auto") -> tuple[float, dict]:
    """mega-tokenize's library call, exactly what the command runs (`--workers 2 --force
    --no-progress --engine ENGINE`), in this process: measured the way the baseline is (imports
    done, no interpreter start), each run building its tokenizer and engine from scratch."""
    from mega_tokenize.pipeline import Options, tokenize

    t0 = time.perf_counter()
    res = tokenize(
        Options(
            inputs=[str(corpus)],
            out=out,
            tokenizer=model,
            engine=engine,
            workers=THREADS,
            force=True,
            progress=False,
        ),
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    dt = time.perf_counter() - t0
    m = res.manifest
    return dt, {"engine": m.engine, "tokens": m.counts.tokens}


def ours_command(corpus: Path, model: Path, out: Path, engine: str = "auto") -> float:
    """The `mega-tokenize` command as a user runs it: interpreter start and imports included."""
    return tokenize_command(corpus, model, out, engine)[0].seconds


def bare_encode_files(corpus: Path, model: Path) -> float:
    """gigatoken reading, parsing and encoding the jsonl itself, 2 threads, nothing written: what
    the issue calls the bare engine (`gigatoken.encode_files`), with our tokenizer.json."""
    import gigatoken

    from mega_tokenize.tokenizer import load_tokenizer, set_threads

    set_threads(THREADS)
    tok = gigatoken.Tokenizer.from_json(load_tokenizer(model).tokenizer_json(strip_special=True))
    tok.encode(["warm the thread pool"][0])
    t0 = time.perf_counter()
    tok.encode_files(gigatoken.JsonlFileSource([str(corpus)], field="text"), parallel=True)
    return time.perf_counter() - t0


def bare_engine(corpus: Path, model: Path, engine: str) -> float:
    """The chosen engine alone on in-memory texts, 2 threads, batched and run concurrently the
    way the tool runs it (the tool's batch sizes, `engine.concurrency` batches at once)."""
    from concurrent.futures import ThreadPoolExecutor

    from mega_tokenize.parsing import batch_sizes
    from mega_tokenize.pipeline import Options
    from mega_tokenize.tokenizer import load_tokenizer, set_threads

    set_threads(THREADS)
    tok = load_tokenizer(model, threads=THREADS)
    eng = tok.engine(engine)
    next_size = batch_sizes([corpus], Options.batch_bytes, THREADS)[0]
    left = corpus.stat().st_size
    batch_bytes = next_size(left)
    batches, cur, size = [], [], 0
    with open(corpus, "rb") as f:
        for line in f:
            t = json.loads(line)["text"]
            cur.append(t)
            size += len(line)
            if size >= batch_bytes:
                batches.append(cur)
                left -= size
                cur, size = [], 0
                batch_bytes = next_size(left)
    if cur:
        batches.append(cur)
    eng.encode(batches[0][:10])  # warm the thread pool
    with ThreadPoolExecutor(max(2, eng.concurrency)) as pool:
        t0 = time.perf_counter()
        for _ in pool.map(eng.encode, batches):
            pass
        return time.perf_counter() - t0


# --- agreement ----------------------------------------------------------------------------------


def agreement(corpus: Path, model: Path, out: Path) -> tuple[int, int]:
    """(documents whose ids equal sentencepiece's + eos, documents of the corpus); raises if the
    shard holds a different number of documents."""
    import sentencepiece as spm

    from megacore.data.indexed import IndexedReader

    sp = spm.SentencePieceProcessor(model_file=str(model))
    reader = IndexedReader(out / "shards" / "text")
    eos = sp.eos_id()
    same = n = 0
    texts: list[str] = []

    def check(texts: list[str]) -> int:
        nonlocal n
        ok = 0
        for ids in sp.encode(texts, num_threads=THREADS):
            if n < len(reader):
                doc = reader[n]
                ok += len(doc) == len(ids) + 1 and doc[-1] == eos and np.array_equal(doc[:-1], ids)
            n += 1
        return ok

    with open(corpus, "rb") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            if len(texts) >= 2000:
                same += check(texts)
                texts = []
    if texts:
        same += check(texts)
    if n != len(reader):
        return min(same, len(reader)), max(n, len(reader))  # missing or extra documents disagree
    return same, n


def index_consistent(prefix: Path) -> str | None:
    """None when a one-sequence-per-document .idx is self-consistent (pointers are the running
    byte sum of the lengths, document indices 0..n), else what is wrong."""
    from megacore.data.indexed import IndexedReader

    r = IndexedReader(prefix)
    lengths = r.sequence_lengths.astype(np.int64)
    pointers = np.concatenate(([0], np.cumsum(lengths)[:-1])) * r.dtype.itemsize
    if not np.array_equal(r.sequence_pointers, pointers[: len(lengths)]):
        return "sequence pointers are not the running sum of the lengths"
    if not np.array_equal(r.document_indices, np.arange(len(lengths) + 1)):
        return "document indices are not 0..n"
    return None


@dataclass
class ShardDiff:
    """Two `.bin/.idx` shards compared: ids per document and every array of the .idx."""

    documents: int  # the reference's
    same_docs: int  # documents whose ids are equal
    mismatches: list[str]  # what differs, empty when the shards are equal

    @property
    def equal(self) -> bool:
        return not self.mismatches

    def summary(self) -> str:
        if self.equal:
            return ".bin ids and .idx (dtype, lengths, pointers, doc indices) equal"
        return "DIFFER: " + ", ".join(self.mismatches)


def compare_shards(ref: Path, ours: Path) -> ShardDiff:
    from megacore.data.indexed import IndexedReader

    a, b = IndexedReader(ref), IndexedReader(ours)
    bad = []
    if a.dtype != b.dtype:
        bad.append(f"dtype {a.dtype} vs {b.dtype}")
    if len(a) != len(b):
        bad.append(f"{len(a)} vs {len(b)} sequences")
    for name in ("sequence_lengths", "sequence_pointers", "document_indices"):
        if not np.array_equal(getattr(a, name), getattr(b, name)):
            bad.append(name.replace("_", " "))
    lengths_equal = len(a) == len(b) and np.array_equal(a.sequence_lengths, b.sequence_lengths)
    if lengths_equal and np.array_equal(a.tokens, b.tokens):
        same = len(a)
    else:  # which documents differ (values compared, whatever the two dtypes)
        same = sum(np.array_equal(a[i], b[i]) for i in range(min(len(a), len(b))))
    if same != len(a):
        bad.append(f"ids of {len(a) - same:,} documents")
    return ShardDiff(len(a), same, bad)


# --- the run ------------------------------------------------------------------------------------


@dataclass
class Timed:
    """The timed paths of one run, each one's times per round (`paired_rounds`)."""

    times: dict[str, list[float]]
    rounds: int

    @property
    def best(self) -> dict[str, float]:
        return {k: min(v) for k, v in self.times.items()}

    def ratio(self, peer: str, us: str) -> float:
        """Median over rounds of peer time / our time in the same round (> 1: we are faster)."""
        return median_ratio(self.times[peer], self.times[us])

    def note(self, peer: str, us: str) -> str:
        return f"median of {self.rounds} paired rounds; best-of {self.best[peer] / self.best[us]:.2f}x"


def warm_paths(
    corpus: Path, model: Path, out: dict[str, Path]
) -> tuple[dict[str, Callable[[], float]], dict]:
    """Our paths, the baseline and the bare engine, each run once to warm up (imports, page cache)
    before any timed round, and the summary of our first run (its engine, tokens)."""
    paths: dict[str, Callable[[], float]] = {
        "base": lambda: megatron_baseline(corpus, model, out["megatron"]),
        "ours": lambda: ours(corpus, model, out["tokens"])[0],
        "ours_sp": lambda: ours(corpus, model, out["tokens-sp"], "sentencepiece")[0],
    }
    paths["base"]()
    _, summary = ours(corpus, model, out["tokens"])
    paths["ours_sp"]()
    engine = summary["engine"]
    paths["bare"] = lambda: bare_engine(corpus, model, engine)
    if engine == "gigatoken":
        paths["files"] = lambda: bare_encode_files(corpus, model)
    paths["fast"] = lambda: megatron_gigatoken_path(corpus, model, out["megatron-gigatoken"])
    paths["cmd"] = lambda: ours_command(corpus, model, out["tokens-cmd"])
    for k in ("bare", "files", "fast", "cmd"):
        if k in paths:
            paths[k]()
    return paths, summary


def megatron_paths(
    checkout: Path | None, corpus: Path, model: Path, out: dict[str, Path], paths: dict, timeout: float
) -> dict[str, str]:
    """Megatron-LM's own commands when a checkout is named, added to `paths` (warmed up) with our
    command on their engine; a peer that cannot run here is left out, its note says why."""
    if checkout is None:
        return {}
    paths["cmd_sp"] = lambda: ours_command(corpus, model, out["tokens-cmd-sp"], "sentencepiece")
    paths["cmd_sp"]()
    common, note = ["--input", str(corpus), "--append-eod"], {}
    try:
        if not (checkout / "tools" / "preprocess_data.py").is_file():
            raise PeerFailed(f"no tools/preprocess_data.py in {checkout}")
        sp_type = megatron_sp_type(checkout)
        args = [*common, "--output-prefix", str(OUT / "mlm"), "--tokenizer-type", sp_type]
        args += ["--tokenizer-model", str(model), "--workers", str(THREADS)]
        note["mlm"] = f"--tokenizer-type {sp_type}"
        paths["mlm"] = lambda: megatron_command(checkout, "preprocess_data.py", args, timeout)
        paths["mlm"]()
    except PeerFailed as e:
        paths.pop("mlm", None)
        note["mlm"] = f"not run: {e}"
    if not (checkout / "tools" / "preprocess_data_fast.py").is_file():
        return note | {"mlm_fast": "not in this checkout"}
    try:
        if "use_gigatoken" not in _checkout_text(checkout, "megatron/training/**/*.py"):
            raise PeerFailed("the checkout has no --use-gigatoken")
        fast = [*common, "--output-prefix", str(OUT / "mlm-fast"), "--tokenizer-type"]
        fast += ["HuggingFaceTokenizer", "--tokenizer-model", str(hf_tokenizer_dir(model)), "--use-gigatoken"]
        paths["mlm_fast"] = lambda: megatron_command(checkout, "preprocess_data_fast.py", fast, timeout)
        paths["mlm_fast"]()
        return note | {
            "mlm_fast": "HuggingFaceTokenizer --use-gigatoken, tokenizer.json from the same .model"
        }
    except (PeerFailed, RuntimeError) as e:  # RuntimeError: no tokenizer.json for this .model
        paths.pop("mlm_fast", None)
        return note | {"mlm_fast": f"not run: {e}"}


def run(quick: bool) -> list[Row]:
    corpus, model = tokenize_inputs(quick)
    rounds = QUICK_ROUNDS if quick else ROUNDS
    mb = corpus.stat().st_size / 1e6
    out = {
        k: OUT / k
        for k in ("tokens", "tokens-sp", "tokens-cmd", "tokens-cmd-sp", "megatron", "megatron-gigatoken")
    }
    paths, summary = warm_paths(corpus, model, out)
    # Megatron-LM's own commands, when a checkout is named; a peer that cannot run becomes a note.
    checkout = Path(os.environ["MEGATRON_LM"]).expanduser() if os.environ.get("MEGATRON_LM") else None
    mlm_note = megatron_paths(checkout, corpus, model, out, paths, 300 if quick else 3600)
    timed = Timed(paired_rounds(paths, rounds, lambda k, _: paths[k](), rotate=True), rounds)

    # Agreement, checked: ids against sentencepiece on every document, and the shards (.bin ids
    # and every .idx array) against the baseline's, whatever engine wrote ours.
    same, n = agreement(corpus, model, out["tokens"])
    idx_problem = index_consistent(out["tokens"] / "shards" / "text")
    vs_base = {
        k: compare_shards(out["megatron"], out[k] / "shards" / "text") for k in ("tokens", "tokens-sp")
    }
    fast_same = compare_shards(out["tokens"] / "shards" / "text", out["megatron-gigatoken"]).same_docs
    engine = summary["engine"]
    lines = [
        f"corpus {mb:.0f} MB, {n:,} documents, {summary['tokens']:,} tokens, tokenizer {model.name}, "
        f"{THREADS} workers, engine {engine}, 1 warm-up + {rounds} rounds of every path",
        *(
            f"{k}: best {min(v):.2f}s, rounds {' '.join(f'{t:.2f}' for t in v)}"
            for k, v in timed.times.items()
        ),
        f"ids equal to sentencepiece on {same:,}/{n:,} documents; .idx: {idx_problem or 'consistent'}",
        *(f"{k} vs baseline: {d.summary()}" for k, d in vs_base.items()),
        f"megatron-style gigatoken fast path: ids equal to ours on {fast_same:,}/{n:,} documents",
    ]
    for line in lines:
        print(f"bench_tokenize: {line}", file=sys.stderr, flush=True)
    rows = speed_rows(timed, mb, engine, f"its ids = ours on {fast_same:,}/{n:,} docs")
    rows.append(
        Row("tokenize", "documents with sentencepiece's ids", f"{same:,}/{n:,}", "sentencepiece", same / max(n, 1),
            "1.00x (all)", f"engine {engine}; .idx {idx_problem or 'self-consistent'}",
            passed=same == n and idx_problem is None)
    )  # fmt: skip
    for label, d in ((f"engine {engine}", vs_base["tokens"]), ("engine sentencepiece", vs_base["tokens-sp"])):
        rows.append(
            Row("tokenize", f"shards = preprocess_data-style baseline ({label})", f"{d.same_docs:,}/{d.documents:,} docs",
                "baseline .bin/.idx", d.same_docs / max(d.documents, 1), "equal", d.summary(), passed=d.equal)
        )  # fmt: skip
    return rows + megatron_rows(checkout, timed, mlm_note, out)


def speed_rows(timed: Timed, mb: float, engine: str, fast_same: str) -> list[Row]:
    """The time rows: ours against the baseline (our default engine, then sentencepiece), the
    gigatoken fast path and the bare engine; the command against the fast path."""
    best, r = timed.best, timed.note
    # The limit is measured against the engine's own file path where it has one (it parses too).
    limit = "files" if "files" in best else "bare"
    base = f"{best['base']:.1f}s (megatron preprocess_data style)"
    fast = f"{best['fast']:.1f}s (gigatoken encode_files + builder)"
    return [
        Row("tokenize", f"time, {mb:.0f} MB corpus, {THREADS} workers", f"{best['ours']:.1f}s", base,
            timed.ratio("base", "ours"), ">= 3x",
            f"engine {engine}; {mb / best['ours']:.1f} vs {mb / best['base']:.1f} MB/s; {r('base', 'ours')}"),
        Row("tokenize", "time, same engine (sentencepiece) both sides", f"{best['ours_sp']:.1f}s", base,
            timed.ratio("base", "ours_sp"), "", f"the pipeline's own gain: --engine sentencepiece; {r('base', 'ours_sp')}"),
        Row("tokenize", "time vs megatron-style gigatoken fast path", f"{best['ours']:.1f}s", fast,
            timed.ratio("fast", "ours"), ">= 1x", f"{fast_same}; {r('fast', 'ours')}"),
        Row("tokenize", "time vs bare engine", f"{best['ours']:.1f}s",
            f"{best[limit]:.1f}s (bare {'gigatoken.encode_files' if limit == 'files' else engine})",
            timed.ratio(limit, "ours"), ">= 0.77x (within 1.3x)",
            f"overhead {best['ours'] / best[limit]:.2f}x; {best['ours'] / best['bare']:.2f}x over encoding "
            f"parsed texts; {r(limit, 'ours')}"),
        Row("tokenize", "mega-tokenize command vs gigatoken fast path", f"{best['cmd']:.1f}s", fast,
            timed.ratio("fast", "cmd"), "",
            f"unlike: incl. interpreter start + imports (peer: warm process); {best['cmd'] / best[limit]:.2f}x bare"),
    ]  # fmt: skip


def megatron_rows(
    checkout: Path | None, timed: Timed, note: dict[str, str], out: dict[str, Path]
) -> list[Row]:
    if checkout is None:
        return [
            Row(
                "tokenize",
                "vs Megatron-LM tools/preprocess_data.py",
                "-",
                "-",
                None,
                "",
                f"skipped: set {ENABLE}",
            )
        ]
    try:
        git = ["git", "-C", str(checkout), "rev-parse", "--short=12", "HEAD"]
        rev = subprocess.run(git, capture_output=True, text=True).stdout.strip()
    except OSError:  # no git: the checkout's name stands for it
        rev = ""
    where = f"Megatron-LM {rev or checkout.name}"
    best, r, rows = timed.best, timed.note, []
    if "mlm" in timed.times:
        mlm = megatron_prefix(OUT / "mlm")
        rows += [
            Row("tokenize", "command vs Megatron-LM preprocess_data.py", f"{best['cmd']:.1f}s",
                f"{best['mlm']:.1f}s ({where})", timed.ratio("mlm", "cmd"), ">= 3x",
                f"both whole commands; ours engine auto, its {note['mlm']}; {r('mlm', 'cmd')}"),
            Row("tokenize", "command, same engine, vs Megatron-LM preprocess_data.py", f"{best['cmd_sp']:.1f}s",
                f"{best['mlm']:.1f}s ({where})", timed.ratio("mlm", "cmd_sp"), "",
                f"both whole commands, both sentencepiece; {r('mlm', 'cmd_sp')}"),
        ]  # fmt: skip
        for label, key in (("engine auto", "tokens-cmd"), ("engine sentencepiece", "tokens-cmd-sp")):
            d = compare_shards(mlm, out[key] / "shards" / "text")
            rows.append(
                Row("tokenize", f"shards = Megatron-LM preprocess_data.py ({label})",
                    f"{d.same_docs:,}/{d.documents:,} docs", f"{where} .bin/.idx",
                    d.same_docs / max(d.documents, 1), "equal", d.summary(), passed=d.equal)
            )  # fmt: skip
    else:
        rows.append(Row("tokenize", "vs Megatron-LM preprocess_data.py", "-", where, None, "", note["mlm"]))
    if "mlm_fast" in timed.times:
        d = compare_shards(out["tokens-cmd"] / "shards" / "text", megatron_prefix(OUT / "mlm-fast"))
        rows.append(
            Row("tokenize", "command vs Megatron-LM preprocess_data_fast.py", f"{best['cmd']:.1f}s",
                f"{best['mlm_fast']:.1f}s ({where})", timed.ratio("mlm_fast", "cmd"), ">= 1x",
                f"{note['mlm_fast']}; its ids = ours on {d.same_docs:,}/{d.documents:,} docs; "
                f"{r('mlm_fast', 'cmd')}")
        )  # fmt: skip
    else:
        rows.append(
            Row("tokenize", "vs Megatron-LM preprocess_data_fast.py", "-", where, None, "", note["mlm_fast"])
        )
    return rows
