"""The code's figures that README.md and docs/*.md quote, each computed by a function from the
code's own constants or output (the planner run as the page states it, a default read off a tool,
a bound read from the test that holds it): tests/test_doc_numbers.py registers each against its
page and phrase."""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import math
import re
import signal
import sys
from pathlib import Path
from types import ModuleType

import msgspec

from megacore import planner
from megacore.config import ModelConfig
from megacore.parallel.layout import Dims
from megacore.parts import model_tensors

ROOT = Path(__file__).resolve().parents[1]


def doc_layout(dims: Dims) -> str:
    """A layout as the pages write it: tp always, then pp, cp and dp where above 1."""
    rest = [f"{name} {n}" for name, n in (("pp", dims.pp), ("cp", dims.cp), ("dp", dims.dp)) if n > 1]
    return " × ".join([f"tp {dims.tp}", *rest])


def _load(relative: str) -> ModuleType:
    """A test module by path, under a name of its own (pytest's importlib mode imports it apart)."""
    name = "doc_numbers_" + Path(relative).stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / relative)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@functools.cache
def literals(relative: str) -> dict[str, object]:
    """A module's constants with literal values, read without running it: the fp8, context and
    equivalence tests import torchao, transformers or a torchrun worker's machinery to run, not to
    state their bounds."""
    out: dict[str, object] = {}
    for node in ast.parse((ROOT / relative).read_text()).body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target = node.targets[0]
        try:
            value = ast.literal_eval(node.value)
        except ValueError:
            continue
        if isinstance(target, ast.Name):
            out[target.id] = value
        elif isinstance(target, ast.Tuple):
            out.update(zip((t.id for t in target.elts), value, strict=True))
    return out


PLANNER_TEST = "tests/train/test_planner.py"
PLANNER_CASES = "tests/planner_cases.py"  # the planner tests' shapes, conditions and searches
FP8_TEST = "tests/train/test_fp8.py"
CONTEXT_TEST = "tests/train/test_context.py"
QLORA_TEST = "tests/train/test_qlora.py"
EQUIVALENCE_WORKER = "tests/parallel/dist_worker.py"  # test_equivalence.py's bounds live there
TOUR_TEST = "tests/test_readme_tour.py"
HARNESS_TEST = "tests/train/test_harness.py"
GPU_MEMORY = "80GB"  # what the pages' planner figures are planned for (test_planner's too)


def planner_test(name: str) -> object:
    """test_planner's conditions and published shapes (its shapes are built by code, hence imported),
    from the module the planner tests import (tests/ is on the path), so that their cached searches
    (`fewest_full_gpus`: seconds for DeepSeek V3) run once for both."""
    return getattr(importlib.import_module(Path(PLANNER_CASES).stem), name)


def gib(n: float) -> str:
    from mega_train.memory_plan import gib as printed

    return printed(n)


def allowance() -> float:
    return planner.ALLOWANCE / planner.GiB


@functools.cache
def plan(shape: str, gpus: int, seq: int, tp: int = 1, pp: int = 1) -> tuple[int, tuple]:
    """The dry run's figures for a model (`test_planner`'s published shape, or Mixtral 8x7B) in
    bf16 at micro batch B and global batch GLOBAL_BATCH: the peak of its own layout (tp x pp, the
    rest dp) and every layout of `gpus` GPUs of GPU_MEMORY, best first."""
    from mega_train.cli import parse_size
    from mega_train.run_plan import parallelism
    from megacore.artifacts.codec import decode_manifest
    from megacore.config import with_context
    from megacore.config_parts import RopeScaling

    micro, batch, trained = planner_test("B"), planner_test("GLOBAL_BATCH"), planner_test("S")
    if shape == "mixtral-8x7b":
        config = msgspec.convert(planner_test("MIXTRAL_8X7B"), ModelConfig)
    else:
        config = msgspec.convert(planner_test("SHAPES")[shape], ModelConfig)
    if seq > config.max_seq_len:  # a longer context, as a run from init sets it beside `init`
        scaling = RopeScaling(type="yarn", factor=seq / trained, original_max_position_embeddings=trained)
        config = with_context(config, seq, scaling)
    run = decode_manifest(
        b'{"kind": "run", "format_version": 1, "out": "run", "model": {"init": "ckpt"}, '
        b'"data": {"sources": [{"path": "tokens"}]}, "precision": "bf16", "train_steps": 1, '
        + f'"batch": {{"micro_batch_size": {micro}, "global_batch_size": {batch}, "seq_length": {seq}}}, '
        f'"parallel": {{"tp": {tp}, "pp": {pp}}}}}'.encode(),
        "run.json",
        "run",
    )
    dims = Dims.for_world(gpus, tp, pp)
    par = parallelism(run, dims.microbatches(batch, micro, "batch"))
    peak = planner.peak(planner.estimate(config, par, dims.dp, micro, seq, run.attention))
    found = planner.search(config, par, gpus, parse_size(GPU_MEMORY), micro, seq, batch, run.attention)
    return peak, tuple(found)


def first_fit(candidates: tuple, ep: bool = False) -> planner.Candidate:
    """The best layout that fits (of those with ep > 1, with `ep`)."""
    return next(c for c in candidates if c.fits and (c.dims.ep > 1) == ep)


def table_row(shape: str) -> tuple:
    """docs/mega-train.md's "How many GPUs" row: Megatron-LLM's layout, its GPUs, its peak rank
    and the allowance, the planner's first pick (without recompute, as the page says all fit)."""
    _, tp, pp = planner_test("FAQ")[shape]
    peak, found = plan(shape, tp * pp, planner_test("S"), tp, pp)
    pick = first_fit(found)
    picked = doc_layout(pick.dims) + ("" if pick.recompute == "none" else f", recompute {pick.recompute}")
    return doc_layout(Dims(tp, pp)), tp * pp, gib(peak), allowance(), picked


def lora_row(name: str, method: str) -> tuple:
    """docs/mega-train.md's LoRA/QLoRA row: the fewest GPUs that fit, the planner's first pick (its
    layout, its recompute as the page writes it), its peak and the allowance (test_planner's search)."""
    config = msgspec.convert(planner_test("LORA_MODELS")[name], ModelConfig)
    gpus, pick = planner_test("fewest_gpus")(config, method == "QLoRA")
    return gpus, doc_layout(pick.dims), pick.recompute, gib(pick.peak), allowance()


def _state_per_parameter() -> tuple[float]:
    """The planner's bytes a trained parameter of fp32 weights, gradients and AdamW's two moments
    (FSDP2 over 2 ranks: no compute copies; the step counters, a tensor each, left out)."""
    from megacore.artifacts.run_spec import ParallelSpec
    from megacore.parallel.layout import Parallelism

    config = ModelConfig(family="llama", vocab_size=64, hidden_size=8, num_layers=1, num_heads=2,
                         num_kv_heads=2, ffn_hidden_size=16)  # fmt: skip
    tensors = model_tensors(config)
    state = planner.rank_state(config, Parallelism(ParallelSpec(), "bf16", 1), 2)
    held = state.weights + state.grads + state.optimizer - 4 * len(tensors)
    return (held * 2 / sum(math.prod(t) for t in tensors.values()),)


def moe_row(name: str) -> tuple:
    """docs/mega-train.md's row of a large mixture of experts: its parameters, the fewest GPUs that
    fit, the planner's first pick (layout, recompute), its peak and the allowance, and the state
    alone per GPU on half as many (16 bytes a trained parameter; test_planner's search)."""
    total, trained = planner_test("moe_parameters")(name)
    gpus, pick = planner_test("fewest_full_gpus")(name)
    layout = planner_test("pick_label")(pick)
    half = gib(_state_per_parameter()[0] * trained / (gpus // 2))
    return f"{total / 1e9:.1f}", gpus, layout, pick.recompute, gib(pick.peak), allowance(), half


def mixtral_counts() -> tuple[str, str]:
    """Its parameters and those active per token, as the dry run's first line prints them (46.7B)."""
    from mega_train.cli import _count
    from megacore.planner.counts import parameter_counts

    return tuple(
        _count(n).removesuffix("B")
        for n in parameter_counts(msgspec.convert(planner_test("MIXTRAL_8X7B"), ModelConfig))
    )


def mixtral_on(gpus: int, ep: bool) -> tuple:
    """Its first pick of `gpus` GPUs (of those with ep > 1, with `ep`): layout, [ep,] peak, allowance."""
    c = first_fit(plan("mixtral-8x7b", gpus, planner_test("S"))[1], ep)
    recompute = "full" if ep else "none"  # what the page says of each
    layout = doc_layout(c.dims) + ("" if c.recompute == recompute else f", recompute {c.recompute}")
    return (gpus, layout, *((c.dims.ep,) if ep else ()), gib(c.peak), allowance())


def mixtral_on_8() -> tuple:
    """Of 8 GPUs none fits: the state alone per GPU (fp32 weights and gradients, AdamW's two fp32
    moments: 16 bytes a parameter, as planner/memory.py counts them), the smallest peak, its layout."""
    from megacore.planner.counts import parameter_counts

    found = plan("mixtral-8x7b", 8, planner_test("S"))[1]
    params = parameter_counts(msgspec.convert(planner_test("MIXTRAL_8X7B"), ModelConfig))[0]
    least = min((c for c in found if c.peak), key=lambda c: c.peak)
    fits = [c.label for c in found if c.fits]
    full = "" if least.recompute == "full" else f", recompute {least.recompute}"
    return (
        8 if not fits else f"8, where {fits[0]} fits",
        gib(16 * params / 8),
        gib(least.peak),
        doc_layout(least.dims) + full,
    )


LONG_SEQ, LONGER_SEQ = 16384, 32768  # Longer context's two lengths, for Llama 2 7B on 8 GPUs


def longer_context() -> tuple:
    """Llama 2 7B at 16k on 8 GPUs: dp 8's own peak without recompute, the first two picks; at 32k
    the first pick."""
    own, found = plan("llama2-7b", 8, LONG_SEQ)
    longer = plan("llama2-7b", 8, LONGER_SEQ)[1]
    a, b, c = found[0], found[1], longer[0]
    return (
        LONG_SEQ // 1024, planner_test("B"), planner_test("GLOBAL_BATCH"), gib(own), allowance(), 8,
        doc_layout(a.dims), gib(a.peak), allowance(), doc_layout(b.dims), gib(b.peak), allowance(),
        LONGER_SEQ // 1024, doc_layout(c.dims), gib(c.peak), allowance(),
    )  # fmt: skip


def yarn_defaults() -> tuple[float | str, float | str]:
    """YaRN's beta_fast and beta_slow when not given: the value that, given, changes nothing
    (`truncate: false`, so every other value moves the ramp)."""
    import torch

    from megacore.config_parts import RopeScaling, RopeSpec
    from megacore.models.rope import inv_freq

    def freqs(**beta: float) -> torch.Tensor:
        scaling = RopeScaling("yarn", 4.0, 4096, truncate=False, **beta)
        shape = {"vocab_size": 128, "hidden_size": 512, "num_heads": 4, "num_kv_heads": 4, "num_layers": 1}
        config = ModelConfig(
            family="llama", ffn_hidden_size=64, max_seq_len=16384, rope=RopeSpec(scaling=scaling), **shape
        )
        return inv_freq(config, 16384)

    def default(name: str) -> float | str:
        given = [v for v in range(1, 129) if torch.equal(freqs(**{name: float(v)}), freqs())]
        return given[0] if len(given) == 1 else f"{name}: {given}"

    return default("beta_fast"), default("beta_slow")


def fp8_capability() -> str:
    """The oldest compute capability whose GPU fp8 is not refused for (the run and dry run's check)."""
    from unittest import mock

    from megacore.errors import UserError
    from megacore.parallel.fp8 import check_float8_matmuls

    ok = []
    for major, minor in [(7, 5), (8, 0), (8, 6), (8, 7), (8, 8), (8, 9), (9, 0), (10, 0)]:
        with (
            mock.patch("torch.cuda.is_available", return_value=True),
            mock.patch("torch.cuda.get_device_capability", return_value=(major, minor)),
        ):
            try:
                check_float8_matmuls("run.json")
                ok.append(f"{major}.{minor}")
            except UserError:
                pass
    return ok[0] if ok else "none"


def flops_coefficients() -> tuple[float, float]:
    """flops_per_token's two coefficients, recovered from it: per matmul parameter (the output
    projection's included, the embedding lookup not) and per layer x head x head_dim x position."""
    from megacore.planner.counts import flops_per_token

    config = msgspec.convert(planner_test("SHAPES")["llama2-7b"], ModelConfig)
    matmul = sum(
        math.prod(s) for n, s in model_tensors(config).items() if len(s) == 2 and n != "embed.weight"
    )
    per_position = config.num_layers * config.num_heads * config.head_dim
    attention = (flops_per_token(config, 2048) - flops_per_token(config, 1024)) / (per_position * 1024)
    return flops_per_token(config, 0) / matmul, attention


# The MFU table's rows: the keys of mega_train.metrics.PEAK_TFLOPS each names, and its label.
MFU_ROWS = [
    (("B200",), "B200"),
    (("H100", "H200", "GH200"), "H100 SXM, H200, GH200"),
    (("H100 PCIe",), "H100 PCIe"),
    (("MI300X",), "MI300X"),
    (("MI250X",), "MI250X"),
    (("L40S",), "L40S"),
    (("A100", "A800"), "A100, A800"),
    (("A10", "V100"), "A10, V100 (fp16)"),
    (("L4",), "L4"),
    (("A10G",), "A10G"),
]


def peak_tflops(keys: tuple[str, ...]) -> tuple[object]:
    from mega_train.metrics import PEAK_TFLOPS

    values = {PEAK_TFLOPS[k] for k in keys}
    return (values.pop() if len(values) == 1 else f"differs within the row: {sorted(values)}",)


def same_for(table: dict[str, float], *keys: str) -> object:
    """One value for several keys, or a text that cannot match the page when they differ."""
    values = {table[k] for k in keys}
    return values.pop() if len(values) == 1 else f"differs: {table}"


def shutdown_timeout() -> int:
    """Plain torchrun's --shutdown-timeout when not given (the environment variable unset)."""
    import os
    from unittest import mock

    from torch.distributed.launcher.api import LaunchConfig

    env = {k: v for k, v in os.environ.items() if k != "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"}
    with mock.patch.dict(os.environ, env, clear=True):
        return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1).shutdown_timeout


def largest_uint16_vocab() -> int:
    """The largest vocab mega-tokenize stores as uint16 ids (bisected on `token_dtype`)."""
    from megacore.data.indexed import token_dtype

    low, high = 1, 1 << 32
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if token_dtype(mid) == "uint16" else (low, mid - 1)
    return low


def pad_multiple() -> tuple[object, int]:
    """mega-convert's --pad-vocab-multiple default (`megacore.config.DEFAULT_PAD_MULTIPLE`) and the
    largest power-of-two tensor-parallel size that divides it."""
    from mega_convert.cli import hf

    given = inspect.signature(hf).parameters["pad_vocab_multiple"].default.default
    return given, given & -given


def _tolerances() -> tuple:
    from mega_convert.verify import DEFAULT_MEAN_TOLERANCE as MEAN
    from mega_convert.verify import DEFAULT_TOLERANCE as MAX

    return (
        MAX["float32"],
        same_for(MAX, "bfloat16", "float16"),
        MEAN["float32"],
        same_for(MEAN, "bfloat16", "float16"),
    )


def _compile_auto() -> tuple[float, float]:
    from mega_train.run_plan import COMPILE_PAYS_S, CPU_TFLOPS

    return CPU_TFLOPS, COMPILE_PAYS_S / 60


def _stop_codes() -> tuple[int, int]:
    from megacore.cli import _stopped

    return _stopped("tool", signal.SIGINT, quiet=True), _stopped("tool", signal.SIGTERM, quiet=True)


def _aborted() -> tuple[int]:
    from mega_train.lifecycle import ABORTED

    return (ABORTED,)


def _shard_size() -> tuple[float]:
    from mega_export.export import MAX_SHARD_BYTES

    return (MAX_SHARD_BYTES / planner.GiB,)


def _weight_decay() -> tuple[float]:
    from megacore.artifacts.run_spec import OptimizerSpec

    return (OptimizerSpec().weight_decay,)


def _gpu_memory() -> tuple[float, float]:
    from mega_train.cli import parse_size

    given = float(re.match(r"\d+", GPU_MEMORY).group(0))
    return given, parse_size(GPU_MEMORY) / planner.GiB


def _nf4() -> tuple[int, int, int]:
    from megacore.config import NF4_BLOCK, NF4_SCALER_BLOCK

    return NF4_BLOCK, NF4_SCALER_BLOCK, NF4_BLOCK * NF4_SCALER_BLOCK


def _stuck_s() -> tuple[float]:
    from mega_train.lifecycle import STUCK_S

    return (STUCK_S,)


def _straggler() -> tuple[float, float]:
    from mega_train.stragglers import FACTOR, MIN_EXCESS_S

    return FACTOR, MIN_EXCESS_S * 1000
