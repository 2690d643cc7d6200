"""What a checkpoint save blocks the training loop for (issue #34): `"checkpoint": {"async": true}`
against the synchronous save, in one run of this file, on the same model.

The model has Llama 3.2 1B's widths (hidden 2048, ffn 8192, 32 heads, 8 kv heads) and 6 of its 16
layers, the real Mistral tokenizer's vocabulary when ../shared has it (0.50B parameters: its fp32
weights and AdamW moments are 6 GB, what this machine's 24 GiB holds twice beside training; the
whole 1B's 13 GB would not leave room for the asynchronous save's host copy). `mega-train` trains
it in bf16 (fp32 master weights) for 9 steps of 1 x 128 tokens, saving every 3; each save's
`blocked_s` is read from metrics.jsonl: the whole save when synchronous, the snapshot (the staging
directory and the copies into host buffers) when asynchronous. Runs alternate sync, async, async,
sync (benchlib's `paired_rounds`, 2 rounds: this machine's speed drifts); the ratio is the mean
synchronous blocked time over the mean asynchronous one (target: async blocks at most 25% of the
sync save, a ratio of at least 4x). `--quick`: 2 layers of hidden 256.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from benchlib import OUT as BENCH_OUT
from benchlib import logger, main, paired_rounds, run_mega_train, text_data
from run import Row

OUT = BENCH_OUT / "async_save"
FULL = {"hidden_size": 2048, "num_layers": 6, "num_heads": 32, "num_kv_heads": 8, "ffn_hidden_size": 8192}
QUICK = {"hidden_size": 256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 512}
STEPS, EVERY = 9, 3
log = logger("async_save")


def one_run(kind: str, dims: dict, tokens: Path, vocab: int, work: Path) -> list[dict]:
    """A run saving `kind`ly: its checkpoint records."""
    manifest = {
        "kind": "run", "format_version": 1,
        "model": {"config": {"family": "llama", "vocab_size": vocab, "max_seq_len": 2048, **dims}},
        "data": {"sources": [{"path": str(tokens)}], "split": [1, 0]},
        "batch": {"micro_batch_size": 1, "global_batch_size": 1, "seq_length": 128},
        "train_steps": STEPS, "precision": "bf16", "compile": False, "eval": {"every": 0},
        "optimizer": {"lr": 3e-4, "warmup_steps": 0}, "logging": {"every": 1},
        "checkpoint": {"every": EVERY, "async": kind == "async"},
    }  # fmt: skip
    records, _ = run_mega_train(manifest, work)
    saves = [r for r in records if r["kind"] == "checkpoint"]
    if len(saves) != STEPS // EVERY or any("error" in r for r in saves):
        raise RuntimeError(f"{kind} run: {len(saves)} saves of {STEPS // EVERY} or one failed: see {work}")
    return saves


def run(quick: bool) -> list[Row]:
    dims = QUICK if quick else FULL
    data = text_data(OUT, 1 << 20)

    def measure(kind: str, r: int) -> list[dict]:
        saves = one_run(kind, dims, data.tokens, data.vocab, OUT / f"run-{r}-{kind}")
        each = (f"step {s['step']} blocked {s['blocked_s']:.2f}s write {s['write_s']:.2f}s" for s in saves)
        log(f"{kind}: {', '.join(each)}")
        return saves

    runs = paired_rounds(("sync", "async"), 2, measure)  # sync, async, then async, sync
    blocked = {kind: [s["blocked_s"] for saves in runs[kind] for s in saves] for kind in runs}
    size = runs["sync"][0][0]["bytes"]
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
            f"{shape}, {size / 1e9:.2f} GB per checkpoint (fp32 weights + AdamW moments), 1 process, "
            f"mean of {len(blocked['sync'])} saves each, runs sync/async/async/sync; blocked s: {each}",
            ratio >= 4,
        )
    ]


if __name__ == "__main__":
    main(run)
