"""What a checkpoint save blocks the training loop for (issue #34): `"checkpoint": {"async": true}`
against the synchronous save, in one run of this file, on the same model.

The model has Llama 3.2 1B's widths (hidden 2048, ffn 8192, 32 heads, 8 kv heads) and 6 of its 16
layers, the real Mistral tokenizer's vocabulary when ../shared has it (0.50B parameters: its fp32
weights and AdamW moments are 6 GB, what this machine's 24 GiB holds twice beside training; the
whole 1B's 13 GB would not leave room for the asynchronous save's host copy). `mega-train` trains
it in bf16 (fp32 master weights) for 9 steps of 1 x 128 tokens, saving every 3; each save's
`blocked_s` is read from metrics.jsonl: the whole save when synchronous, the snapshot (the staging
directory and the copies into host buffers) when asynchronous. Runs alternate sync, async, async,
sync (this machine's speed drifts); the ratio is the mean synchronous blocked time over the mean
asynchronous one (target: async blocks at most 25% of the sync save, a ratio of at least 4x).
`--quick`: 2 layers of hidden 256.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from bench_train import BIN, THREADS, child_env, corpus, launch, mega_train_command, tokenizer
from run import Row

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench-out" / "async_save"
FULL = {"hidden_size": 2048, "num_layers": 6, "num_heads": 32, "num_kv_heads": 8, "ffn_hidden_size": 8192}
QUICK = {"hidden_size": 256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 512}
STEPS, EVERY = 9, 3
ORDER = ("sync", "async", "async", "sync")


def log(msg: str) -> None:
    print(f"   async_save: {msg}", file=sys.stderr, flush=True)


def prepare_tokens() -> tuple[Path, int]:
    OUT.mkdir(parents=True, exist_ok=True)
    text = corpus(OUT / "corpus.jsonl", size=1 << 20)
    tokens = OUT / "tokens"
    if not (tokens / "manifest.json").is_file():
        subprocess.run(
            [BIN / "mega-tokenize", text, tokens, "--tokenizer", tokenizer(OUT, text), "--no-progress",
             "--workers", str(THREADS)],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
    return tokens, json.loads((tokens / "manifest.json").read_text())["tokenizer"]["vocab_size"]


def one_run(kind: str, dims: dict, tokens: Path, vocab: int, work: Path) -> list[dict]:
    """A run saving `kind`ly: its checkpoint records."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out = work / "run-out"
    manifest = {
        "kind": "run", "format_version": 1, "out": str(out),
        "model": {"config": {"family": "llama", "vocab_size": vocab, "max_seq_len": 2048, **dims}},
        "data": {"sources": [{"path": str(tokens)}], "split": [1, 0]},
        "batch": {"micro_batch_size": 1, "global_batch_size": 1, "seq_length": 128},
        "train_steps": STEPS, "precision": "bf16", "compile": False, "eval": {"every": 0},
        "optimizer": {"lr": 3e-4, "warmup_steps": 0}, "logging": {"every": 1},
        "checkpoint": {"every": EVERY, "async": kind == "async"},
    }  # fmt: skip
    (work / "run.json").write_text(json.dumps(manifest, indent=2))
    rc, _ = launch(
        [*mega_train_command(), "--manifest", work / "run.json"], work / "log.txt", child_env(), work
    )
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] if rc == 0 else []
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # GBs
    saves = [r for r in records if r["kind"] == "checkpoint"]
    if rc or len(saves) != STEPS // EVERY or any("error" in r for r in saves):
        raise RuntimeError(f"{kind} run failed (exit {rc}): see {work / 'log.txt'}")
    return saves


def run(quick: bool) -> list[Row]:
    dims = QUICK if quick else FULL
    tokens, vocab = prepare_tokens()
    blocked: dict[str, list[float]] = {"sync": [], "async": []}
    sizes = []
    for i, kind in enumerate(ORDER):
        saves = one_run(kind, dims, tokens, vocab, OUT / f"run-{i}-{kind}")
        log(
            f"{kind}: "
            + ", ".join(
                f"step {r['step']} blocked {r['blocked_s']:.2f}s write {r['write_s']:.2f}s" for r in saves
            )
        )
        blocked[kind] += [r["blocked_s"] for r in saves]
        sizes.append(saves[0]["bytes"])
    sync, asyn = statistics.mean(blocked["sync"]), statistics.mean(blocked["async"])
    ratio = sync / asyn
    each = "; ".join(f"{k} " + "/".join(f"{x:.2f}" for x in v) for k, v in blocked.items())
    shape = "quick sizes" if quick else "Llama 3.2 1B widths, 6 layers"
    return [
        Row(
            "async_save",
            "checkpoint save: training blocked per save, async vs sync",
            f"{asyn:.2f} s",
            f"{sync:.2f} s",
            ratio,
            "async <= 25% of sync (>= 4x)",
            f"{shape}, {sizes[0] / 1e9:.2f} GB per checkpoint (fp32 weights + AdamW moments), 1 process, "
            f"mean of {len(blocked['sync'])} saves each, runs sync/async/async/sync; blocked s: {each}",
            ratio >= 4,
        )
    ]


if __name__ == "__main__":
    from run import table

    print(table(run("--quick" in sys.argv)))
