"""GPU training throughput: a ~1.1B Llama trained by `mega-train` in bf16 on one GPU, attention
`sdpa` and `flash`, tokens/s and MFU of each. Skipped (one row saying so) where there is no CUDA.

The model has TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads, 4 kv heads, ffn 5632) and
the tokenizer's vocab (the Mistral tokenizer's 32000 when ../shared has it); seq 2048, micro batch
8 x 2 accumulation = 16 sequences (32,768 tokens) a step; AdamW, bf16 compute copies of fp32 master
weights, recompute none, 4 warm-up steps and 20 timed ones (`--quick`: 2 layers, 2 and 3 steps).
tokens/s = the timed steps' tokens / the sum of the `step_time_s` mega-train logs for them; TFLOP/s
and MFU are the medians of what mega-train logs for those steps (MFU against its table's peak for
the GPU: 989 TFLOP/s dense bf16 for an H100 or H200); memory is torch.cuda's peak allocated.

`flash` is flash-attn when installed, else PyTorch's own FlashAttention kernels (the note says
which); `sdpa` lets PyTorch choose. Then the faster of the two once more with `"compile": true`
(every block torch.compiled). The `flash` row's ratio is flash against sdpa in the same run.

Data: token ids mega-tokenize wrote from the standard library's sources (benchlib's `gpu_data`),
made on the first run and reused: a GPU machine with no tokenizer at hand is given this directory
(bench-out/gpu/tokens) ready made.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from benchlib import LLAMA_1B, OUT, Setup, gpu_data, logger, measure_mega_train
from run import Row

FULL = LLAMA_1B
QUICK = replace(FULL, layers=2, warmup=2, timed=3)
WORK = OUT / "gpu" / "work"
log = logger("gpu")


def flash_kernel() -> str:
    try:
        import flash_attn

        return f"flash-attn {flash_attn.__version__}"
    except ImportError:
        import torch

        return f"PyTorch {torch.__version__}'s FlashAttention (flash-attn not installed)"


def row(name: str, res: dict, setup: Setup, note: str = "") -> Row:
    metric = f"mega-train {setup.layers}-layer bf16, {name}: tokens/s"
    if "error" in res:
        return Row("gpu", metric, "-", "-", None, note=res["error"])
    recs = res["records"]
    tflops = statistics.median(r["tflops"] for r in recs)
    mfu = [r["mfu"] for r in recs if r["mfu"] is not None]
    losses = f"loss {recs[0]['loss']:.2f} -> {recs[-1]['loss']:.2f}"
    detail = [f"{tflops:.0f} TFLOP/s", f"MFU {100 * statistics.median(mfu):.1f}%" if mfu else "MFU -"]
    detail += [f"peak {max(r['memory_gb'] for r in recs):.1f} GB", losses]
    return Row(
        "gpu", metric, f"{res['tokens_per_s']:,.0f}", "-", None, note="; ".join(detail + [note] * bool(note))
    )


def run(quick: bool) -> list[Row]:
    import torch

    if not torch.cuda.is_available():
        return [Row("gpu", "mega-train ~1.1B bf16 on a GPU", "-", "-", None, note="skipped: no CUDA device")]
    data = gpu_data()
    setup, tokens = replace(QUICK if quick else FULL, vocab=data.vocab), data.tokens
    log(f"{torch.cuda.get_device_name()}; flash = {flash_kernel()}")
    results = {}
    for attention in ("sdpa", "flash"):
        log(f"1.1B, attention {attention} ...")
        results[attention] = measure_mega_train(setup, tokens, WORK / attention, attention=attention)
        log(f"  {results[attention].get('tokens_per_s', results[attention].get('error'))}")
    rows = [
        row("attention sdpa", results["sdpa"], setup),
        row("attention flash", results["flash"], setup, flash_kernel()),
    ]
    speeds = {a: r["tokens_per_s"] for a, r in results.items() if "tokens_per_s" in r}
    if len(speeds) == 2:
        rows[1].peer, rows[1].ratio = f"{speeds['sdpa']:,.0f}", speeds["flash"] / speeds["sdpa"]
    if speeds:
        best = max(speeds, key=speeds.get)
        log(f"1.1B, attention {best}, compiled ...")
        res = measure_mega_train(setup, tokens, WORK / "compiled", compile=True, attention=best)
        rows.append(row(f'attention {best} "compile": true', res, setup))
    return rows
