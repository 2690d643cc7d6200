"""mega-tokenize against Megatron-LM's `tools/preprocess_data.py` (and a look-alike of it), side by side.

Corpus: real text found on this machine (the Python standard library's sources, then the text of
/usr/share/doc, then the .py files of the venv's packages) as jsonl, one file per document, at
least 200 MB (`--quick`: 8 MB). Built once, cached in bench-out/ (git-ignored).

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
order rotated every round, on the same page-cached corpus. Ratios are the median over rounds of
peer time / ours in the same round (the machine is shared: its speed drifts within minutes); the
times shown are each path's best.
Agreement (checked, the run exits 1 when one fails): ours against sentencepiece on every document,
and our shards against the baseline's and Megatron-LM's: the .bin ids and the .idx (dtype,
sequence lengths, sequence pointers, document indices).
"""

from __future__ import annotations

import gzip
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from run import Row

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench-out" / "tokenize"
MODEL = ROOT.parent / "shared" / "assets" / "mistral-v1-tokenizer.model"
WORKERS = 2
MAX_DOC = 1 << 20  # a file larger than this is split into documents at line boundaries
ROUNDS = 5  # paired rounds after the warm-up (--quick: QUICK_ROUNDS)
QUICK_ROUNDS = 3
ENABLE = "MEGATRON_LM=/path/to/Megatron-LM (a checkout) to run its tools/preprocess_data.py"
# Subprocesses get the thread settings the in-process paths run under.
SUB_ENV = {"OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": str(WORKERS)}


def _text_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    files += sorted(p for p in Path("/usr/share/doc").rglob("*") if p.is_file() and not p.is_symlink())
    files += sorted(Path(sysconfig.get_paths()["purelib"]).rglob("*.py"))
    venv = ROOT / ".venv" / "lib"
    if venv.is_dir():
        files += sorted(venv.rglob("*.py"))
    return files


def _read_text(p: Path) -> str | None:
    try:
        data = p.read_bytes()
        if p.suffix == ".gz":
            data = gzip.decompress(data)
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None
    return text if text.strip() and "\x00" not in text else None


def build_corpus(target_bytes: int) -> Path:
    path = OUT / f"corpus-{target_bytes >> 20}MB.jsonl"
    if path.is_file():
        return path
    OUT.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    size, seen = 0, set()
    with open(tmp, "w", encoding="utf-8") as f:
        for p in _text_files():
            key = os.path.realpath(p)
            if key in seen:
                continue
            seen.add(key)
            text = _read_text(p)
            if text is None:
                continue
            while text:
                cut = len(text) if len(text) <= MAX_DOC else text.rfind("\n", 0, MAX_DOC) + 1 or MAX_DOC
                line = json.dumps({"text": text[:cut], "src": str(p)}, ensure_ascii=False) + "\n"
                f.write(line)
                size += len(line.encode())
                text = text[cut:]
            if size >= target_bytes:
                break
    if size < target_bytes:
        print(f"bench_tokenize: only {size >> 20} MB of text found on this machine", file=sys.stderr)
    tmp.rename(path)
    return path


def _tokenizer_model() -> Path:
    if MODEL.is_file():
        return MODEL
    import sentencepiece as spm

    out = OUT / "trained-8k.model"
    if not out.is_file():
        files = [p for p in _text_files()[:2000]]
        lines = [ln for p in files if (t := _read_text(p)) for ln in t.splitlines() if ln.strip()]
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines[:200_000]),
            model_prefix=str(out.with_suffix("")),
            vocab_size=8000,
            model_type="bpe",
            byte_fallback=True,
            minloglevel=2,
        )
    return out


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
        pool = multiprocessing.get_context("fork").Pool(WORKERS, initializer=encoder.initializer)
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
    path = os.pathsep.join(p for p in (str(checkout), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, **SUB_ENV, "PYTHONPATH": path}


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
    cmd = [_megatron_python(), str(checkout / "tools" / script), *args]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=_megatron_env(checkout), timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PeerFailed(f"{script} ran past {timeout:.0f}s") from None
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise PeerFailed(f"{script} exited {p.returncode}: {_why(p.stderr, checkout)}")
    return dt


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
            workers=WORKERS,
            force=True,
            progress=False,
        ),
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    dt = time.perf_counter() - t0
    m = res.manifest
    return dt, {"engine": m.engine, "tokens": m.counts.tokens}


def ours_command(corpus: Path, model: Path, out: Path, engine: str = "auto") -> tuple[float, dict]:
    """The `mega-tokenize` command as a user runs it: interpreter start and imports included."""
    exe = Path(sys.executable).parent / "mega-tokenize"
    args = [str(corpus), str(out), "-t", str(model), "--workers", str(WORKERS), "--engine", engine]
    t0 = time.perf_counter()
    p = subprocess.run(
        [str(exe), *args, "--force", "--no-progress", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, **SUB_ENV},
    )
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"mega-tokenize failed: {p.stderr}")
    return dt, json.loads(p.stdout)


def bare_encode_files(corpus: Path, model: Path) -> float:
    """gigatoken reading, parsing and encoding the jsonl itself, 2 threads, nothing written: what
    the issue calls the bare engine (`gigatoken.encode_files`), with our tokenizer.json."""
    import gigatoken

    from mega_tokenize.tokenizer import load_tokenizer, set_threads

    set_threads(WORKERS)
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

    set_threads(WORKERS)
    tok = load_tokenizer(model, threads=WORKERS)
    eng = tok.engine(engine)
    next_size = batch_sizes([corpus], Options.batch_bytes, WORKERS)[0]
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
        for ids in sp.encode(texts, num_threads=WORKERS):
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


def paired_rounds(paths: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Every path once to warm up (the caller has done that), then `rounds` rounds of each once,
    the order rotated every round so that no path always runs right after the same neighbour."""
    keys, times = list(paths), {k: [] for k in paths}
    for r in range(rounds):
        shift = r % len(keys)
        for k in keys[shift:] + keys[:shift]:
            times[k].append(paths[k]())
    return times


def paired(times: dict[str, list[float]], peer: str, ours: str) -> float:
    """Median over rounds of peer time / our time in the same round (> 1: we are faster)."""
    return statistics.median(p / o for p, o in zip(times[peer], times[ours], strict=True))


def run(quick: bool) -> list[Row]:
    target = (8 if quick else 200) << 20
    rounds = QUICK_ROUNDS if quick else ROUNDS
    corpus = build_corpus(target)
    model = _tokenizer_model()
    mb = corpus.stat().st_size / 1e6
    timeout = 300 if quick else 3600
    out = {
        k: OUT / k
        for k in ("tokens", "tokens-sp", "tokens-cmd", "tokens-cmd-sp", "megatron", "megatron-gigatoken")
    }
    base_prefix, fast_prefix = out["megatron"], out["megatron-gigatoken"]
    paths: dict[str, Callable[[], float]] = {
        "base": lambda: megatron_baseline(corpus, model, base_prefix),
        "ours": lambda: ours(corpus, model, out["tokens"])[0],
        "ours_sp": lambda: ours(corpus, model, out["tokens-sp"], "sentencepiece")[0],
    }
    # Warm-up of every path (imports, page cache, .pyc of a checkout) before any timed round.
    paths["base"]()
    _, summary = ours(corpus, model, out["tokens"])
    paths["ours_sp"]()
    engine = summary["engine"]
    gigatoken_files = engine == "gigatoken"
    paths["bare"] = lambda: bare_engine(corpus, model, engine)
    if gigatoken_files:
        paths["files"] = lambda: bare_encode_files(corpus, model)
    paths["fast"] = lambda: megatron_gigatoken_path(corpus, model, fast_prefix)
    paths["cmd"] = lambda: ours_command(corpus, model, out["tokens-cmd"])[0]
    for k in ("bare", "files", "fast", "cmd"):
        if k in paths:
            paths[k]()

    # Megatron-LM's own commands, when a checkout is named; a peer that cannot run becomes a note.
    checkout = Path(os.environ["MEGATRON_LM"]).expanduser() if os.environ.get("MEGATRON_LM") else None
    mlm_note: dict[str, str] = {}
    mlm_prefix, mlm_fast_prefix = OUT / "mlm", OUT / "mlm-fast"
    if checkout is not None:
        paths["cmd_sp"] = lambda: ours_command(corpus, model, out["tokens-cmd-sp"], "sentencepiece")[0]
        paths["cmd_sp"]()
        common = ["--input", str(corpus), "--append-eod"]
        try:
            if not (checkout / "tools" / "preprocess_data.py").is_file():
                raise PeerFailed(f"no tools/preprocess_data.py in {checkout}")
            sp_type = megatron_sp_type(checkout)
            args = [*common, "--output-prefix", str(mlm_prefix), "--tokenizer-type", sp_type]
            args += ["--tokenizer-model", str(model), "--workers", str(WORKERS)]
            mlm_note["mlm"] = f"--tokenizer-type {sp_type}"
            paths["mlm"] = lambda: megatron_command(checkout, "preprocess_data.py", args, timeout)
            paths["mlm"]()
        except PeerFailed as e:
            paths.pop("mlm", None)
            mlm_note["mlm"] = f"not run: {e}"
        if (checkout / "tools" / "preprocess_data_fast.py").is_file():
            try:
                if "use_gigatoken" not in _checkout_text(checkout, "megatron/training/**/*.py"):
                    raise PeerFailed("the checkout has no --use-gigatoken")
                fast = [*common, "--output-prefix", str(mlm_fast_prefix), "--tokenizer-type"]
                fast += ["HuggingFaceTokenizer", "--tokenizer-model", str(hf_tokenizer_dir(model))]
                fast += ["--use-gigatoken"]
                paths["mlm_fast"] = lambda: megatron_command(
                    checkout, "preprocess_data_fast.py", fast, timeout
                )
                paths["mlm_fast"]()
                mlm_note["mlm_fast"] = (
                    "HuggingFaceTokenizer --use-gigatoken, tokenizer.json from the same .model"
                )
            except (PeerFailed, RuntimeError) as e:  # RuntimeError: no tokenizer.json for this .model
                paths.pop("mlm_fast", None)
                mlm_note["mlm_fast"] = f"not run: {e}"
        else:
            mlm_note["mlm_fast"] = "not in this checkout"

    times = paired_rounds(paths, rounds)
    best = {k: min(v) for k, v in times.items()}
    t_files = best.get("files")
    # The limit is measured against the engine's own file path where it has one (it parses too).
    limit = "files" if t_files is not None else "bare"

    # Agreement, checked: ids against sentencepiece on every document, and the shards (.bin ids
    # and every .idx array) against the baseline's, whatever engine wrote ours.
    same, n = agreement(corpus, model, out["tokens"])
    idx_problem = index_consistent(out["tokens"] / "shards" / "text")
    vs_base = {k: compare_shards(base_prefix, out[k] / "shards" / "text") for k in ("tokens", "tokens-sp")}
    fast_same = compare_shards(out["tokens"] / "shards" / "text", fast_prefix).same_docs

    def r(peer: str, us: str) -> str:
        return f"median of {rounds} paired rounds; best-of {best[peer] / best[us]:.2f}x"

    lines = [
        f"corpus {mb:.0f} MB, {n:,} documents, {summary['tokens']:,} tokens, tokenizer {model.name}, "
        f"{WORKERS} workers, engine {engine}, 1 warm-up + {rounds} rounds of every path",
        *(f"{k}: best {best[k]:.2f}s, rounds {' '.join(f'{t:.2f}' for t in v)}" for k, v in times.items()),
        f"ids equal to sentencepiece on {same:,}/{n:,} documents; .idx: {idx_problem or 'consistent'}",
        *(f"{k} vs baseline: {d.summary()}" for k, d in vs_base.items()),
        f"megatron-style gigatoken fast path: ids equal to ours on {fast_same:,}/{n:,} documents",
    ]
    for line in lines:
        print(f"bench_tokenize: {line}", file=sys.stderr, flush=True)
    sp_base = vs_base["tokens-sp"]
    rows = [
        Row(
            "tokenize",
            f"time, {mb:.0f} MB corpus, {WORKERS} workers",
            f"{best['ours']:.1f}s",
            f"{best['base']:.1f}s (megatron preprocess_data style)",
            paired(times, "base", "ours"),
            ">= 3x",
            f"engine {engine}; {mb / best['ours']:.1f} vs {mb / best['base']:.1f} MB/s; {r('base', 'ours')}",
        ),
        Row(
            "tokenize",
            "time, same engine (sentencepiece) both sides",
            f"{best['ours_sp']:.1f}s",
            f"{best['base']:.1f}s (megatron preprocess_data style)",
            paired(times, "base", "ours_sp"),
            "",
            f"the pipeline's own gain: --engine sentencepiece; {r('base', 'ours_sp')}",
        ),
        Row(
            "tokenize",
            "time vs megatron-style gigatoken fast path",
            f"{best['ours']:.1f}s",
            f"{best['fast']:.1f}s (gigatoken encode_files + builder)",
            paired(times, "fast", "ours"),
            ">= 1x",
            f"its ids = ours on {fast_same:,}/{n:,} docs; {r('fast', 'ours')}",
        ),
        Row(
            "tokenize",
            "time vs bare engine",
            f"{best['ours']:.1f}s",
            f"{best[limit]:.1f}s (bare {'gigatoken.encode_files' if t_files else engine})",
            paired(times, limit, "ours"),
            ">= 0.77x (within 1.3x)",
            f"overhead {best['ours'] / best[limit]:.2f}x; {best['ours'] / best['bare']:.2f}x over encoding "
            f"parsed texts; {r(limit, 'ours')}",
        ),
        Row(
            "tokenize",
            "mega-tokenize command vs gigatoken fast path",
            f"{best['cmd']:.1f}s",
            f"{best['fast']:.1f}s (gigatoken encode_files + builder)",
            paired(times, "fast", "cmd"),
            "",
            f"unlike: incl. interpreter start + imports (peer: warm process); {best['cmd'] / best[limit]:.2f}x bare",
        ),
        Row(
            "tokenize",
            "documents with sentencepiece's ids",
            f"{same:,}/{n:,}",
            "sentencepiece",
            same / max(n, 1),
            "1.00x (all)",
            f"engine {engine}; .idx {idx_problem or 'self-consistent'}",
            passed=same == n and idx_problem is None,
        ),
        *(
            Row(
                "tokenize",
                f"shards = preprocess_data-style baseline ({label})",
                f"{d.same_docs:,}/{d.documents:,} docs",
                "baseline .bin/.idx",
                d.same_docs / max(d.documents, 1),
                "equal",
                d.summary(),
                passed=d.equal,
            )
            for label, d in ((f"engine {engine}", vs_base["tokens"]), ("engine sentencepiece", sp_base))
        ),
    ]
    rows += megatron_rows(checkout, times, best, mlm_note, out, rounds)
    return rows


def megatron_rows(
    checkout: Path | None,
    times: dict[str, list[float]],
    best: dict[str, float],
    note: dict[str, str],
    out: dict[str, Path],
    rounds: int,
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

    def r(peer: str, us: str) -> str:
        return f"median of {rounds} paired rounds; best-of {best[peer] / best[us]:.2f}x"

    rows = []
    if "mlm" in times:
        mlm = megatron_prefix(OUT / "mlm")
        rows += [
            Row("tokenize", "command vs Megatron-LM preprocess_data.py", f"{best['cmd']:.1f}s",
                f"{best['mlm']:.1f}s ({where})", paired(times, "mlm", "cmd"), ">= 3x",
                f"both whole commands; ours engine auto, its {note['mlm']}; {r('mlm', 'cmd')}"),
            Row("tokenize", "command, same engine, vs Megatron-LM preprocess_data.py", f"{best['cmd_sp']:.1f}s",
                f"{best['mlm']:.1f}s ({where})", paired(times, "mlm", "cmd_sp"), "",
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
    if "mlm_fast" in times:
        d = compare_shards(out["tokens-cmd"] / "shards" / "text", megatron_prefix(OUT / "mlm-fast"))
        rows.append(
            Row("tokenize", "command vs Megatron-LM preprocess_data_fast.py", f"{best['cmd']:.1f}s",
                f"{best['mlm_fast']:.1f}s ({where})", paired(times, "mlm_fast", "cmd"), ">= 1x",
                f"{note['mlm_fast']}; its ids = ours on {d.same_docs:,}/{d.documents:,} docs; "
                f"{r('mlm_fast', 'cmd')}")
        )  # fmt: skip
    else:
        rows.append(
            Row("tokenize", "vs Megatron-LM preprocess_data_fast.py", "-", where, None, "", note["mlm_fast"])
        )
    return rows
