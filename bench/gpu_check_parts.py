"""The parts of `make gpu-check` (bench/gpu_check.py, which says what each covers), one per process:
`python bench/gpu_check_parts.py NAME` runs part NAME on the GPU and writes its record, {"status":
"passed" | "failed" | "skipped", "reason": ..., "figures": {...}}, to the file named by
$GPU_CHECK_RESULT (the peers' after each model, so that a cut keeps what was done). $GPU_CHECK_SECONDS
is the time the part was given (the peers choose their models by it). A check that does not hold
makes the part "failed" with the checks that failed as its reason; an exception exits 1, its
traceback in the part's log.

Every figure is measured by the part itself; no GPU has run it yet (see bench/README.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from unittest import mock

if TYPE_CHECKING:  # the parent (gpu_check.py) imports no torch; the parts import it when they run
    import torch

ROOT = Path(__file__).resolve().parents[1]
RESULT_ENV, SECONDS_ENV = "GPU_CHECK_RESULT", "GPU_CHECK_SECONDS"
# Every test that needs CUDA (grep tests for `cuda`): gpt-oss's sink attention on the GPU's path too.
CUDA_TESTS = (
    "tests/models/test_cuda.py",
    "tests/models/test_gpt_oss.py::test_sink_kernel_forward_and_backward_equal_the_formula",
)
# The fp8 part: a Llama whose block linears all run float8 (dims multiples of 16), one fixed batch
# learnt for STEPS steps from the same weights in bf16 and in fp8.
FP8_MODEL = dict(
    family="llama", vocab_size=32000, hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=4,
    ffn_hidden_size=2816, max_seq_len=1024,
)  # fmt: skip
FP8_STEPS, FP8_BATCH = 12, 8
# Twice the bound the CPU tests hold under torchao's emulation (tests/train/test_fp8.py, 1%): the
# float8 matmuls accumulate in another order than emulation's bf16 ones; the worst step is reported.
FP8_REL = 0.02
# The grouped-matmul part: a MoE layer's experts (Mixtral's top-2 of 8, smaller), rows routed unevenly.
MOE = dict(experts=8, hidden=2048, ffn=5632, rows=16384)
# The context-parallel part: a 32k row, Llama 3 8B's attention heads; cp sizes and cases.
CP_ROW = dict(seq=32768, heads=32, kv_heads=8, head_dim=128)
CP_SIZES = (2, 4, 8)
CP_CASES = {"causal": (None, False), "window 4096": (4096, False), "documents": (None, True)}
BF16_REL = 2e-2  # bf16 against fp32, norm-wise: tests/models/test_cuda.py's bound
# bench_gpu_peers' models in the order they run, each with the seconds its docstring's budget gives
# it (its steps, starts, compiles, checkpoints and the fp8 row: ~400 s for both), not yet measured.
PEERS_S = {"1.1B": 190.0, "3B": 215.0}


def skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


def verdict(figures: dict, failures: list[str]) -> dict:
    """passed, or failed naming every check that did not hold."""
    if failures:
        return {"status": "failed", "reason": "; ".join(failures), "figures": figures}
    return {"status": "passed", "figures": figures}


def rel(got, want) -> float:
    """Norm-wise relative error of `got` against `want`."""
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


def free_gib() -> float:
    import torch

    return torch.cuda.mem_get_info()[0] / 2**30


def too_little_memory(need_gib: float) -> str:
    """Why a part cannot run for memory ('' when it can)."""
    free = free_gib()
    return f"needs {need_gib:.0f} GiB of GPU memory free, {free:.1f} GiB are" if free < need_gib else ""


# --- cuda_tests ----------------------------------------------------------------------------------


def junit_figures(xml: Path) -> dict:
    """Counts, time, failed test ids and skip reasons from pytest's junit XML."""
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed, skips = [], set()
    for case in suite.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        if (skip := case.find("skipped")) is not None:
            skips.add(skip.get("message", ""))
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {**counts, "seconds": float(suite.get("time", 0)), "failed": failed, "skip_reasons": sorted(skips)}


def cuda_tests() -> dict:
    """pytest on the CUDA tests; passed when pytest exits 0 and some test ran."""
    xml = Path(os.environ[RESULT_ENV]).with_suffix(".junit.xml")
    cmd = [sys.executable, "-m", "pytest", *CUDA_TESTS, "-q", f"--junitxml={xml}"]
    rc = subprocess.run(cmd, cwd=ROOT, check=False).returncode
    if not xml.is_file():
        return verdict({"exit": rc}, [f"pytest exited {rc} without a report"])
    figures = {"exit": rc, **junit_figures(xml)}
    ran = figures["tests"] - figures["skipped"]
    failures = [f"pytest exited {rc}"] * (rc != 0) + ["no test ran"] * (ran == 0)
    return verdict(figures, failures)


# --- fp8 -----------------------------------------------------------------------------------------


def train_curve(
    precision: str,
    device: str = "cuda",
    model: dict = FP8_MODEL,
    steps: int = FP8_STEPS,
    rows: int = FP8_BATCH,
) -> dict:
    """`steps` steps of the engine (one process) on one fixed batch of `rows` sequences: the losses,
    the float8 linears it made and whether any emulates float8."""
    import torch

    from megacore.artifacts.run_spec import ParallelSpec
    from megacore.config import ModelConfig
    from megacore.parallel.engine import ParallelModel
    from megacore.parallel.layout import Parallelism
    from megacore.parallel.mesh import build_mesh

    config = ModelConfig(**model)
    pm = ParallelModel(config, Parallelism(ParallelSpec(), precision=precision), build_mesh(), device)
    pm.init_weights(seed=0)
    float8 = [m for part in pm.parts for m in part.modules() if type(m).__name__ == "Float8Linear"]
    params = list(pm.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, fused=device == "cuda")
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, config.vocab_size, (rows, config.max_seq_len + 1), generator=g).to(device)
    losses, t0 = [], time.perf_counter()
    for _ in range(steps):
        step = pm.forward_backward(batch[:, :-1], batch[:, 1:])
        loss = getattr(step, "loss", step)  # a `Step` (its loss on the device), or the loss itself
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # one process: plain tensors, as mega-train clips
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    emulated = sorted({bool(m.config.emulate) for m in float8})
    return {
        "losses": losses,
        "seconds": time.perf_counter() - t0,
        "float8_linears": len(float8),
        "emulated": emulated,
    }


def fp8_failures(bf16: dict, fp8: dict, layers: int) -> tuple[float, list[str]]:
    """The worst step's relative loss difference, and the checks that do not hold."""
    worst = max(abs(a - b) / abs(b) for a, b in zip(fp8["losses"], bf16["losses"], strict=True))
    checks = {
        "a loss is not finite": all(math.isfinite(x) for x in bf16["losses"] + fp8["losses"]),
        "the bf16 loss did not fall": bf16["losses"][-1] < bf16["losses"][0],
        f"fp8 made {fp8['float8_linears']} float8 linears, not {7 * layers}": fp8["float8_linears"]
        == 7 * layers,
        f"float8 emulated ({fp8['emulated']})": fp8["emulated"] == [False],
        "fp8's losses are bf16's: nothing rounded to float8": fp8["losses"] != bf16["losses"],
        f"fp8 {100 * worst:.3f}% from bf16 at its worst step (bound {100 * FP8_REL:g}%)": worst <= FP8_REL,
    }
    return worst, [what for what, holds in checks.items() if not holds]


def fp8() -> dict:
    """precision fp8 (tensorwise) against bf16 through the engine, real float8 matmuls."""
    import torch

    if importlib.util.find_spec("torchao") is None:
        return skipped("torchao not installed: carry its wheel (bench/README.md)")
    if torch.cuda.get_device_capability() < (8, 9):
        return skipped(f"no float8 matmuls on compute capability {torch.cuda.get_device_capability()}")
    if why := too_little_memory(8):
        return skipped(why)
    bf16 = train_curve("bf16")
    torch.cuda.empty_cache()
    low = train_curve("fp8")
    worst, failures = fp8_failures(bf16, low, FP8_MODEL["num_layers"])
    figures = {
        "model": FP8_MODEL, "steps": FP8_STEPS, "tokens_per_step": FP8_BATCH * FP8_MODEL["max_seq_len"],
        "bf16_losses": bf16["losses"], "fp8_losses": low["losses"], "worst_rel_diff": worst,
        "float8_linears": low["float8_linears"], "seconds": {"bf16": bf16["seconds"], "fp8": low["seconds"]},
    }  # fmt: skip
    return verdict(figures, failures)


# --- grouped_mm ----------------------------------------------------------------------------------


@contextlib.contextmanager
def loop_path() -> Iterator[None]:
    """`grouped_swiglu` takes `torch._grouped_mm` where torch has it: hidden, the loop over the
    experts runs on the GPU in bf16 too (the path a torch without it takes)."""
    import torch

    saved = torch._grouped_mm
    del torch._grouped_mm
    try:
        yield
    finally:
        torch._grouped_mm = saved


def expert_inputs(experts: int, hidden: int, ffn: int, rows: int) -> tuple:
    """Rows sorted by expert, counts as a router gives them (uneven, not multiples of 8, expert 1
    without rows), the stacked weights and an output gradient; fp32 on the CPU."""
    import torch

    g = torch.Generator().manual_seed(0)
    share = torch.softmax(torch.randn(experts, generator=g), 0)
    share[1] = 0
    counts = torch.bincount(torch.multinomial(share, rows, replacement=True, generator=g), minlength=experts)
    x = torch.randn(rows, hidden, generator=g)
    weights = [
        torch.randn(experts, *s, generator=g) * 0.02 for s in ((ffn, hidden), (ffn, hidden), (hidden, ffn))
    ]
    return x, counts, weights, torch.randn(rows, hidden, generator=g)


def placed(inputs: tuple, dtype, device: str = "cuda") -> tuple:
    """`expert_inputs` on `device`, the floats in `dtype` (once: the timings leave the copies out)."""
    x, counts, weights, dy = inputs
    return (
        x.to(device, dtype),
        counts.to(device),
        [w.to(device, dtype) for w in weights],
        dy.to(device, dtype),
    )


def run_experts(inputs: tuple) -> list:
    """grouped_swiglu forward and backward on `placed` inputs: [output, grad x, grad gate, grad up,
    grad down]."""
    from megacore.models.moe import grouped_swiglu

    x, counts, weights, dy = inputs
    leaves = [t.detach().requires_grad_() for t in (x, *weights)]
    out = grouped_swiglu(leaves[0], counts, *leaves[1:])
    out.backward(dy)
    return [out.detach(), *(t.grad for t in leaves)]


def median_ms(fn: Callable[[], object], warmup: int = 2, reps: int = 5) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[reps // 2]


def grouped_mm() -> dict:
    """The experts through `torch._grouped_mm` in bf16 against the loop in bf16 and fp32."""
    import torch

    if not hasattr(torch, "_grouped_mm"):
        return skipped(f"torch {torch.__version__} has no torch._grouped_mm")
    if why := too_little_memory(8):
        return skipped(why)
    inputs = expert_inputs(**MOE)
    want = run_experts(placed(inputs, torch.float32))  # fp32 takes the loop
    low = placed(inputs, torch.bfloat16)
    grouped, grouped_ms = run_experts(low), median_ms(lambda: run_experts(low))
    with loop_path():
        loop, loop_ms = run_experts(low), median_ms(lambda: run_experts(low))
    names = ("output", "grad_x", "grad_gate", "grad_up", "grad_down")
    errors = {
        n: {"grouped_vs_fp32": rel(a, c), "loop_vs_fp32": rel(b, c), "grouped_vs_loop": rel(a, b)}
        for n, a, b, c in zip(names, grouped, loop, want, strict=True)
    }
    figures = {**MOE, "counts": inputs[1].tolist(), "errors": errors, "grouped_ms": grouped_ms,
               "loop_ms": loop_ms, "speedup": loop_ms / grouped_ms}  # fmt: skip
    return verdict(figures, experts_failures(errors))


def experts_failures(errors: dict[str, dict[str, float]]) -> list[str]:
    """The grouped matmul within bf16's rounding of the loop's bf16, and no further from fp32 than
    BF16_REL or twice the loop's own error, whichever is larger."""
    out = []
    for name, e in errors.items():
        if e["grouped_vs_fp32"] > max(BF16_REL, 2 * e["loop_vs_fp32"]):
            out.append(
                f"{name}: grouped {e['grouped_vs_fp32']:.2e} from fp32 (the loop {e['loop_vs_fp32']:.2e})"
            )
        if e["grouped_vs_loop"] > BF16_REL:
            out.append(f"{name}: grouped {e['grouped_vs_loop']:.2e} from the loop")
    return out


# --- cp_32k --------------------------------------------------------------------------------------


def simulated_cp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: int,
    window: int | None,
    segments: torch.Tensor | None,
) -> torch.Tensor:
    """Context parallel's attention over the whole row [B, S, ...] as `cp` ranks compute it: every
    rank's `ContextParallelAttention` on its shards, in this process. Only the communication is
    stood in for: the all-gather hands each rank every rank's shard of the tensor it gave, in rank
    order (the shards of the whole row, `shard_sequence`), and gradients reach the whole row's
    tensors through them (what the reduce-scatter sums). Returns the ranks' outputs as one row."""
    import torch

    from megacore.parallel import cp as cpm

    whole: dict[int, torch.Tensor] = {}  # a rank's shard (by identity) -> the whole row it is a shard of

    def gather(t: torch.Tensor, group: object = None) -> torch.Tensor:
        return torch.cat([cpm.shard_sequence(whole[id(t)], cp, j) for j in range(cp)])

    def gather_sequence(t: torch.Tensor, group: object, n: int) -> torch.Tensor:
        return cpm.unshard_sequence(gather(t), n)

    outs = []
    with (
        mock.patch.object(cpm, "_gather", gather),
        mock.patch.object(cpm, "gather_sequence", gather_sequence),
    ):
        for rank in range(cp):
            mine = [cpm.shard_sequence(t, cp, rank) for t in (q, k, v, segments)]
            whole.clear()
            whole.update({id(s): t for s, t in zip(mine[1:], (k, v, segments), strict=True) if t is not None})
            kernel = cpm.ContextParallelAttention(None, cp, rank)
            outs.append(kernel(mine[0], mine[1], mine[2], window, "auto", mine[3]))
    return cpm.unshard_sequence(torch.cat(outs), cp)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None,
    segments: torch.Tensor | None,
    backends: list | None = None,
) -> torch.Tensor:
    """One fp32 attention over the whole row, its kv heads repeated for every query head and the
    causal, window and document rules one boolean mask (`backends`: SDPA's kernels to allow)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    s, rep = q.shape[1], q.shape[2] // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
    i = torch.arange(s, device=q.device)
    mask = i[:, None] >= i[None, :]
    if window is not None:  # j > i - window, compared as is: no S x S integers
        mask &= i[None, :] > (i - window)[:, None]
    mask = mask[None, None]
    if segments is not None:
        mask = mask & (segments[:, :, None] == segments[:, None, :])[:, None]
    with sdpa_kernel(backends) if backends else contextlib.nullcontext():
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)


def attention_inputs(row: dict, documents: bool, device: str) -> tuple:
    """q, k, v and an output gradient [1, S, heads, D] (fp32) and, for packed documents, 7 documents
    of random lengths' ids [1, S]."""
    import torch

    g = torch.Generator().manual_seed(0)
    s, d = row["seq"], row["head_dim"]
    q, k, v, dy = (torch.randn(1, s, h, d, generator=g).to(device)
                   for h in (row["heads"], row["kv_heads"], row["kv_heads"], row["heads"]))  # fmt: skip
    segments = None
    if documents:
        cuts = torch.randint(1, s, (6,), generator=g).sort().values
        segments = torch.bucketize(torch.arange(s), cuts, right=True)[None].to(device)
    return q, k, v, dy, segments


def attention_errors(base: tuple, want: list, cp: int, window: int | None) -> dict:
    """bf16 attention of the whole row at `cp` (1: the row's own kernel; else `simulated_cp`) forward
    and backward: its output's and q/k/v gradients' errors against `want`, and its time."""
    import torch

    from megacore.models.attention import causal_attention

    q, k, v, dy, segments = base
    leaves = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    t0 = time.perf_counter()
    if cp == 1:
        got = causal_attention(*leaves, window, "auto", segments)
    else:
        got = simulated_cp(*leaves, cp, window, segments)
    got.backward(dy.to(torch.bfloat16))
    if got.is_cuda:
        torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - t0)
    errs = [rel(a, w) for a, w in zip([got.detach(), *(t.grad for t in leaves)], want, strict=True)]
    return {**dict(zip(("output", "grad_q", "grad_k", "grad_v"), errs, strict=True)), "ms": ms}


def attention_case(
    row: dict, window: int | None, documents: bool, device: str, sizes=CP_SIZES, backends=None
) -> dict:
    """One case at cp 1 (the whole row's own kernel: bf16's floor) and every cp size, against the
    fp32 reference; an error (out of memory, a kernel refusing) is that entry's record."""
    import torch

    base = attention_inputs(row, documents, device)
    q, k, v, dy, segments = base
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = reference_attention(*leaves, window, segments, backends)
    out.backward(dy)
    want = [out.detach(), *(t.grad for t in leaves)]
    del out, leaves
    results = {}
    for cp in (1, *sizes):
        try:
            results[f"cp{cp}"] = attention_errors(base, want, cp, window)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            results[f"cp{cp}"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def case_failures(cases: dict) -> list[str]:
    """Every entry above BF16_REL, or a cp size that failed to run (cp 1, the row without context
    parallel, is the floor the others are read against: its errors are in the figures)."""
    out = []
    for name, case in cases.items():
        for cp, errs in case.items():
            if "error" in errs and cp != "cp1":
                out.append(f"{name} {cp}: {errs['error']}")
            out += [
                f"{name} {cp} {w} {e:.2e}"
                for w, e in errs.items()
                if w not in ("ms", "error") and e > BF16_REL
            ]
    return out


def suffix_kernel() -> str:
    """The kernel a late chunk's attention takes on this GPU (`attention.suffix_attention`)."""
    from megacore.models import attention

    if attention._flash_attn_func() is not None:
        return "flash-attn"
    return "torch varlen_attn" if attention._torch_varlen() is not None else "SDPA lower-right causal bias"


def cp_32k() -> dict:
    """Context parallel's attention at 32k tokens, simulated cp 2/4/8 on this GPU, against fp32."""
    import torch
    from torch.nn.attention import SDPBackend

    if why := too_little_memory(40):
        return skipped(why)
    cases = {}
    for name, (window, documents) in CP_CASES.items():
        efficient = [SDPBackend.EFFICIENT_ATTENTION]  # fp32 with a mask, no S x S scores held
        cases[name] = attention_case(CP_ROW, window, documents, "cuda", backends=efficient)
        torch.cuda.empty_cache()
    figures = {**CP_ROW, "cp_sizes": list(CP_SIZES), "suffix_kernel": suffix_kernel(), "cases": cases,
               "bound": BF16_REL}  # fmt: skip
    failures = case_failures(cases)
    return verdict(figures, failures)


# --- peers ---------------------------------------------------------------------------------------


def peers_models(seconds: float, budget: dict[str, float] = PEERS_S) -> tuple[list[str], list[str]]:
    """The peers' models to run in `seconds`, in order while each one's documented time still fits,
    and a line for each left out."""
    chosen, left_out, left = [], [], seconds
    for name, need in budget.items():
        if need <= left:
            chosen.append(name)
            left -= need
        else:
            left_out.append(f"{name}: {left:.0f} s left of the part's time, its documented ~{need:.0f} s")
    return chosen, left_out


def write_result(record: dict) -> None:
    Path(os.environ[RESULT_ENV]).write_text(json.dumps(record, indent=1))


def peers() -> dict:
    """bench/bench_gpu_peers.py, model by model, its rows written after each."""
    if str(ROOT / "bench") not in sys.path:  # the bench modules import each other by file name
        sys.path.insert(0, str(ROOT / "bench"))
    import bench_gpu_peers as bench

    chosen, left_out = peers_models(float(os.environ.get(SECONDS_ENV, "inf")))
    if not chosen:
        return skipped("; ".join(left_out))
    bench.absolute_pythonpath()
    rows, record = [], {}
    for name in chosen:
        rows += [dataclasses.asdict(r) for r in bench.model_rows(name, bench.MODELS[name], quick=False)]
        failed = [f"{r['metric']}: {r['note']}" for r in rows if r["passed"] is False]
        figures = {"models": chosen[: chosen.index(name) + 1], "left_out": left_out, "rows": rows}
        record = verdict(figures, failed)
        write_result(record)
    return record


PARTS: dict[str, Callable[[], dict]] = {
    "cuda_tests": cuda_tests, "fp8": fp8, "grouped_mm": grouped_mm, "cp_32k": cp_32k, "peers": peers,
}  # fmt: skip


if __name__ == "__main__":
    write_result(PARTS[sys.argv[1]]())
