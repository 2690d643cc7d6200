"""Corpus files to a `tokens` artifact: read, parse, encode, write; one pass, bounded memory.

A reader thread streams and parses the input (decompression and JSON parsing in C; Parquet row
groups decoded by pyarrow into the same Python strings, see inputs.py), encoding
threads turn batches into checked, EOS/BOS-wrapped ids (the engine and numpy release the GIL;
`--workers` batches at once for gigatoken, whose calls each run on their thread), and the main
thread appends them to the shards, which hash and flush as they grow. Batches are written in input
order and a document's ids do not depend on its batch, so the shards are byte-identical for any
`--workers`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from mega_tokenize import __version__
from mega_tokenize.chat import ROLE_CODES
from mega_tokenize.encoding import Encoder, EngineChecks, EngineDisagrees, in_order
from mega_tokenize.job import Job, Options, prepare
from mega_tokenize.preference import PREFERENCE_ROLES
from mega_tokenize.shards import Shards
from mega_tokenize.tokenizer import Engine, Tokenizer, candidate_engine
from megacore.artifacts import ArtifactWriter, write_artifact
from megacore.artifacts import manifest as mf
from megacore.artifacts.header import new_header_fields
from megacore.artifacts.output import reusable
from megacore.background import Background
from megacore.errors import UserError
from megacore.progress import Progress

__all__ = ["Options", "Result", "tokenize"]  # the library's entry: tokenize(Options(...)) (Options: job.py)


@dataclass
class Result:
    manifest: mf.TokensManifest
    reused: bool
    seconds: float = 0.0
    input_bytes: int = 0


def tokenize(opts: Options, log: Callable[[str], None] | None = None) -> Result:
    """Build (or reuse) the tokens artifact at `opts.out`.

    The engine's ids are checked against the reference tokenizer on a sample of every batch while
    the run goes on (off the critical path); if they differ, nothing is committed: `auto` starts
    over with the reference, a named engine is an error."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        return _tokenize(opts, log)
    except EngineDisagrees as e:
        if opts.engine != "auto":
            raise UserError(f"{e}; use --engine {e.reference} or auto") from None
        log(f"mega-tokenize: WARNING: {e}; starting over with {e.reference} (slower, same ids)")
        return _tokenize(replace(opts, engine=e.reference), log)


def _tokenize(opts: Options, log: Callable[[str], None]) -> Result:
    t0 = time.perf_counter()
    job = prepare(opts)
    out = Path(opts.out)
    if not opts.force and (old := reusable(out, "tokens", job.recipe)) is not None:
        return Result(old, reused=True, seconds=time.perf_counter() - t0)
    # The output must not be (or be inside, or contain) an input: a directory of inputs is searched
    # recursively, and a tokens artifact inside it would become input of the next run.
    read = job.dataset.files if job.dataset else job.files  # a dataset's: its local files, streamed or not
    policy_inputs = [*read, opts.tokenizer, *(Path(i) for i in opts.inputs if Path(i).is_dir())]
    with write_artifact(out, "tokens", inputs=policy_inputs, force=opts.force, recipe=job.recipe) as w:
        tok_files = _copy_tokenizer(job.tok, w)
        shards, engine, input_bytes = _encode_all(job, w, log)
        manifest = w.commit(_manifest(job, tok_files, shards, engine))
    return Result(manifest, reused=False, seconds=time.perf_counter() - t0, input_bytes=input_bytes)


def _copy_tokenizer(tok: Tokenizer, w: ArtifactWriter) -> list[str]:
    """The tokenizer's files under `tokenizer/`; a SentencePiece model always as `tokenizer.model`
    (the name Hugging Face loaders look for), whatever it was called; its directory's other files
    (tokenizer_config.json, a chat template) by their own names."""
    model = None
    if tok.type == "sentencepiece":
        model = next((f for f in tok.files if f.suffix == ".model"), tok.files[0])
    rels = []
    for f in tok.files:
        rel = "tokenizer/tokenizer.model" if f == model else f"tokenizer/{f.name}"
        w.path(rel).write_bytes(f.read_bytes())
        rels.append(rel)
    return rels


def _encode_all(job: Job, w: ArtifactWriter, log: Callable[[str], None]) -> tuple[Shards, Engine, int]:
    """The encode loop: read and parse on a helper thread, encode on a pool, write in input order.

    A sample of every batch is checked against the reference on a thread of its own; every check
    has passed before this returns (and anything is committed)."""
    opts = job.opts
    chat, prompts = opts.format != "text", opts.format == "prompts"
    shards = Shards(w, job.keys, job.dtype, job.bos, job.eos, chat=chat, columns=prompts)
    shown = Progress("mega-tokenize", "docs", extras=("tokens",), enabled=None if opts.progress else False)
    input_bytes = 0
    pool = checks = None
    # Engines run max(2, workers) batches at once (see Engine.concurrency).
    batches = Background.source(job.parsed(max(2, opts.workers)), name="mega-tokenize-reader")
    try:
        engine = candidate_engine(job.tok, opts.engine, log)  # built while the reader parses the first batch
        pool = ThreadPoolExecutor(engine.concurrency, thread_name_prefix="mega-tokenize-encode")
        checks = EngineChecks(job.tok, engine)
        encode = Encoder(job, engine)
        for parsed, encoded in in_order(checks.sampled(batches), encode, pool, engine.concurrency):
            ndocs, ntok = shards.write(parsed, encoded)
            shown.update(ndocs, parsed.nbytes, tokens=ntok)
            input_bytes += parsed.nbytes
        checks.passed(wait=True)  # before anything is committed
        shards.close()
    except BaseException:
        batches.cancel()
        for ex in (pool, checks):
            if ex is not None:
                ex.shutdown(wait=True, cancel_futures=True)
        shards.abort()
        raise
    pool.shutdown()
    checks.shutdown()
    shown.done()
    if shards.documents == 0:
        raise UserError(
            f"no documents in the input ({job.skips.count} lines skipped)", ", ".join(opts.inputs)
        )
    return shards, engine, input_bytes


def _manifest(job: Job, tok_files: list[str], written: Shards, engine: Engine) -> mf.TokensManifest:
    opts, tok = job.opts, job.tok
    shards = written.entries()
    return mf.TokensManifest(
        **new_header_fields("mega-tokenize", __version__),
        tokenizer=mf.TokenizerInfo(
            type=tok.type,
            files=tok_files,
            vocab_size=tok.vocab_size,
            fingerprint=job.settings["tokenizer"],
            base_vocab_size=tok.base_vocab_size,
            bos_id=tok.bos_id,
            eos_id=tok.eos_id,
            pad_id=tok.pad_id,
            unk_id=tok.unk_id,
            added_special_tokens=dict(tok.added),
            stop_ids=tok.stop_ids,
        ),
        dtype=job.dtype,
        format=opts.format,
        append_eos=opts.append_eos,
        prepend_bos=opts.prepend_bos,
        chat_template=job.template,
        roles=dict(
            {"chat": ROLE_CODES, "prompts": ROLE_CODES, "preference": PREFERENCE_ROLES}.get(opts.format, {})
        ),
        column_types=written.column_types,
        engine=engine.name,
        json_keys=job.keys if opts.format == "text" else [],
        on_error=opts.on_error,
        inputs=job.inputs,
        dataset=job.dataset.record if job.dataset else None,
        shards=shards,
        counts=mf.TokenCounts(
            documents=shards[0].documents,
            pairs=shards[0].documents // 2 if opts.format == "preference" else 0,  # two documents each
            tokens=sum(s.tokens for s in shards),
            skipped_lines=job.skips.count,
            skipped_examples=job.skips.examples,
        ),
    )
