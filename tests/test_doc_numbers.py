"""No number in README.md or docs/*.md that a test does not regenerate or check by value: every
figure the pages quote in prose is registered in CHECKED, keyed by its page and its phrase, with a
function that computes the figure from the code's own constants or output (the planner run as the
page states it, a default read off the tool, a bound imported from the test that holds it).

A figure is a number with a decimal point or an exponent, with a unit or suffix (%, ×, x, k, B, M,
s, minutes, GiB, GB, MB, TFLOP/s, tokens/s, ...), or of 10 and more. What is not scanned, and why:

- the generated `<!-- BEGIN ... --help -->` blocks: tests/test_docs.py holds them to the tools'
  output, character for character;
- fenced code blocks tagged with a language (bash, json, python): commands, run.json and JSON the
  reader types, inputs rather than claims. The `#` lines under the dry run in README's tour are
  output, not input: tests/train/test_planner.py::test_the_readme_tour_prints_the_planners_plan
  holds them to the planner's by value (test_the_readme_tours_output_is_held_by_the_planner_test
  checks that it does). An untagged block (a diagram, a directory tree) is a picture, and scanned;
- inline code spans (names, fields, values the reader types) and link targets;
- names: a number that is part of a model, product or version name (Llama 3.2, Qwen 2.5, Falcon
  40B, Mixtral 8×7B, Python 3.11): NAMES, each pattern one a page needs (a pattern that matches
  nothing is stale and fails). A number glued to letters before it (H100, bf16, Qwen3, SIGUSR1) or
  after it with no unit (1F1B, 3D) is part of a name by construction;
- small structural integers below 10 with no unit: exit codes, ranks, dims, tp/pp sizes of
  examples, counts ("2 processes").

bench/README.md is the benchmark record, where measurements live with what measured them; it is
not scanned. A figure that is a measurement belongs there, not on a tool page."""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import math
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import msgspec
import pytest

from megacore import planner
from megacore.config import ModelConfig
from megacore.parallel.layout import Dims
from megacore.parts import model_tensors

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
ADVICE = "register it with a check, or move a measurement to bench/README.md"

# --- the extractor -------------------------------------------------------------------------------

HELP_BLOCK = re.compile(r"^<!-- BEGIN (.+?) --help.*?^<!-- END \1 --help -->", re.S | re.M)
FENCE = re.compile(r"^[ \t]*```(\w*)[^\n]*\n.*?^[ \t]*```[ \t]*$", re.S | re.M)
# Inline code may run over a line break, never over a blank line (markdown's paragraph).
INLINE_CODE = re.compile(r"`(?:[^`\n]|\n(?![ \t]*\n))+`")
LINK_TARGET = re.compile(r"(?<=\])\([^)\s]*\)")
NUMBER = r"\d{1,3}(?:,\d{3})+(?![\d.])|\d+(?:\.\d+)?(?:e[-+]?\d+)?"
FIGURE = re.compile(rf"(?<![\w.])(?:{NUMBER})")
GLUED_UNIT = re.compile(r"(?:%|×|x|k|K|B|M|GB|GiB|MB|MiB|KB|TB|s|ms)(?![A-Za-z])")
SPACED_UNIT = re.compile(
    r"[ \t]?(?:%|GiB|GB|MiB|MB|KiB|KB|TiB|TB|TFLOP/s|GFLOP|tokens/s|s|ms|minutes?|seconds?|hours?|bytes)"
    r"(?![A-Za-z])|-(?:minute|second|hour|day)s?\b"
)
# Names with numbers in them, each pattern as narrow as the pages allow.
NAMES = [
    r"Llama \d(?:\.\d)?(?:[-/]\d(?:\.\d)?)*(?: \d+B)?",  # Llama 3.2, Llama 1/2/3/3.1/3.2, Llama 2 70B
    r"Qwen \d(?:\.\d)?(?: / \d(?:\.\d)?)*",  # Qwen 2.5, Qwen 2 / 2.5 / 3
    r"\b\d+B-A\d+B\b",  # Qwen3-30B-A3B's total and active sizes
    r"\b(?:Mistral|Falcon) \d+B",  # Mistral 7B, Falcon 40B
    r"\bMixtral \d+×\d+B",  # Mixtral 8×7B
    r"\bPython \d+\.\d+\+?",  # Python 3.11+
    r"\bDeepSeek V3 \d+B",  # DeepSeek V3 671B
    r"\bgpt-oss \d+B",  # gpt-oss 120B
    r"\bGLM-4\.\d(?:/4\.\d)*(?:-Air)?(?: \d+B)?",  # GLM-4.5/4.6/4.7, GLM-4.5-Air 106B
]


@dataclass(frozen=True)
class Figure:
    doc: str
    start: int
    end: int
    text: str
    line: int
    context: str

    def report(self) -> str:
        return f"{self.doc}:{self.line}: {self.text!r} in '…{self.context}…' is not checked: {ADVICE}"


def _blank(m: re.Match) -> str:
    """The match as spaces, its line breaks kept: offsets and line numbers stay the page's."""
    return re.sub(r"[^\n]", " ", m.group(0))


def _fenced(m: re.Match) -> str:
    """A tagged block blanked whole (an input); an untagged one (a picture) kept, its fences blanked
    so that their backticks do not read as inline code."""
    if m.group(1):
        return _blank(m)
    first, *inner, last = m.group(0).split("\n")
    return "\n".join([" " * len(first), *inner, " " * len(last)])


def prose(text: str) -> str:
    """The page with everything not scanned (module docstring) blanked out."""
    text = HELP_BLOCK.sub(_blank, text)
    text = FENCE.sub(_fenced, text)
    text = INLINE_CODE.sub(_blank, text)
    return LINK_TARGET.sub(_blank, text)


def _is_figure(text: str, number: str, end: int) -> bool:
    """A decimal, an exponent, 10 or more, or a number with a unit; not one glued to a name."""
    after = text[end : end + 12]
    if after[:1].isalpha():  # 7B, 16k, 80GB are figures; 1F1B and 3D are names
        return GLUED_UNIT.match(after) is not None
    if re.search(r"[.e]", number) or float(number.replace(",", "")) >= 10:
        return True
    return after.startswith("×") or SPACED_UNIT.match(after) is not None  # 2× ; 4 GiB, 3%


def figures(doc: str, text: str) -> list[Figure]:
    """Every figure of a page's prose, names left out."""
    scanned = prose(text)
    named = [m.span() for p in NAMES for m in re.finditer(p, scanned)]
    out = []
    for m in FIGURE.finditer(scanned):
        if any(a <= m.start() < b for a, b in named) or not _is_figure(scanned, m.group(0), m.end()):
            continue
        context = " ".join(scanned[max(0, m.start() - 45) : m.end() + 30].split())
        out.append(
            Figure(doc, m.start(), m.end(), m.group(0), scanned.count("\n", 0, m.start()) + 1, context)
        )
    return out


# --- checks ----------------------------------------------------------------------------------------

LAYOUT = r"tp \d+(?:\s+×\s+(?:pp|cp|dp)\s+\d+)*"  # a layout as the pages write it: tp 1 × pp 2 × cp 4


@dataclass(frozen=True)
class Check:
    """A page's figures in their phrase: literal text with `{}` for a number, `{layout}` for a
    layout and `{word}` for a word (any whitespace matching any), and the values the code gives for
    them, in order: a str is compared as written, a number by value (1,024 = 1024; 4 = 4.0)."""

    doc: str
    phrase: str
    values: Callable[[], tuple]

    def regex(self) -> re.Pattern:
        parts = re.split(r"(\{\}|\{layout\}|\{word\})", self.phrase)
        out = []
        for part in parts:
            if part == "{}":
                out.append(f"({NUMBER})")
            elif part == "{layout}":
                out.append(f"({LAYOUT})")
            elif part == "{word}":
                out.append(r"(\w+)")
            else:
                out.append(r"\s+".join(re.escape(w) for w in part.split(" ")))
        return re.compile("".join(out))


def _same(got: str, want: object) -> bool:
    got = " ".join(got.split())
    if isinstance(want, str):
        return got == want
    return math.isclose(float(got.replace(",", "")), float(want), rel_tol=1e-12)


def doc_layout(dims: Dims) -> str:
    """A layout as the pages write it: tp always, then pp, cp and dp where above 1."""
    rest = [f"{name} {n}" for name, n in (("pp", dims.pp), ("cp", dims.cp), ("dp", dims.dp)) if n > 1]
    return " × ".join([f"tp {dims.tp}", *rest])


# --- the code's figures ----------------------------------------------------------------------------


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


TRAIN = "docs/mega-train.md"
EQ = literals(EQUIVALENCE_WORKER)
CHECKED: list[Check] = [
    # A title, not a timing: no code measures the tour; test_readme_tour.py's SECTION reads it by name.
    Check(
        "README.md", "A {}-minute tour", lambda: (int(re.search(r"\d+", literals(TOUR_TEST)["SECTION"])[0]),)
    ),
    Check("docs/architecture.md", "{} interrupted (Ctrl-C), {} terminated (SIGTERM)", _stop_codes),
    Check("docs/architecture.md", "a second Ctrl-C aborts ({})", _aborted),
    Check(
        "docs/mega-convert.md",
        "({} by default: divisible by every power-of-two tensor-parallel size up to {})",
        pad_multiple,
    ),
    Check(
        "docs/mega-convert.md",
        "(default {} in float32, {} in bf16/fp16) or the mean above ({} / {})",
        _tolerances,
    ),
    Check("docs/mega-export.md", "(with an index above {} GiB)", _shard_size),
    Check(
        "docs/mega-tokenize.md",
        "uint16 ids when the vocab fits in {}, else int32",
        lambda: (largest_uint16_vocab(),),
    ),
    Check(TRAIN, "the step's FLOPs at {} TFLOP/s) is at least {} minutes", _compile_auto),
    Check(TRAIN, "a GPU of compute capability {} or newer", lambda: (fp8_capability(),)),
    Check(
        TRAIN,
        "{} steps of a tiny Llama stay within {}% of bf16's loss",
        lambda: (literals(FP8_TEST)["STEPS"], 100 * literals(FP8_TEST)["FP8_REL"]),
    ),
    Check(
        TRAIN,
        "{} × the parameters that take part in a matmul (every layer's projections and the output layer, "
        "not the embedding lookup; a mixture of experts' active experts) plus {} × layers",
        flops_coefficients,
    ),
    Check(
        TRAIN,
        "torchtitan reports ({} × the parameters less the embedding's + {} × layers",
        flops_coefficients,
    ),
    *[Check(TRAIN, f"| {label} | {{}} |", functools.partial(peak_tflops, keys)) for keys, label in MFU_ROWS],
    Check(TRAIN, "plus a fixed {} GiB allowance", lambda: (allowance(),)),
    Check(TRAIN, "(binary units: {}GB = {} GiB)", _gpu_memory),
    Check(
        TRAIN,
        "layouts for {} GB GPUs (full fine-tuning, bf16, sequence {}, micro batch {}, global batch {})",
        lambda: (_gpu_memory()[0], planner_test("S"), planner_test("B"), planner_test("GLOBAL_BATCH")),
    ),
    Check(
        TRAIN, "| Llama 2 7B | {layout} ({} GPUs) | {} + {} GiB | {layout} |", lambda: table_row("llama2-7b")
    ),
    Check(
        TRAIN, "| Mistral 7B | {layout} ({} GPUs) | {} + {} GiB | {layout} |", lambda: table_row("mistral-7b")
    ),
    Check(TRAIN, "| Falcon 40B | {layout} ({}) | {} + {} GiB | {layout} |", lambda: table_row("falcon-40b")),
    Check(TRAIN, "| Llama 2 70B | {layout} ({}) | {} + {} GiB | {layout} |", lambda: table_row("llama2-70b")),
    Check(TRAIN, "Mixtral 8×7B ({}B parameters, {}B active per token", mixtral_counts),
    Check(TRAIN, "LoRA and QLoRA (rank {} on every projection", lambda: (planner_test("LORA_RANK"),)),
    Check(TRAIN, "The fewest {} GB GPUs that fit", lambda: (_gpu_memory()[0],)),
    *(
        Check(
            TRAIN,
            f"| {name} | {method} | {{}} | {{layout}}, recompute {{word}} | {{}} + {{}} GiB |",
            lambda name=name, method=method: lora_row(name, method),
        )
        for name in ("Llama 2 7B", "Llama 2 70B", "Mixtral 8×7B")
        for method in ("LoRA", "QLoRA")
    ),
    *(
        Check(
            TRAIN,
            f"| {name} | {{}}B | {{}} | {{layout}}, recompute {{word}} | {{}} + {{}} GiB | {{}} GiB |",
            lambda name=name: moe_row(name),
        )
        for name in ("DeepSeek V3 671B", "gpt-oss 120B", "gpt-oss 20B", "GLM-4.5 355B", "GLM-4.5-Air 106B")
    ),
    Check(TRAIN, "the fewest {} GB GPUs (a power of 2) that fit", lambda: (_gpu_memory()[0],)),
    Check(TRAIN, "moments alone ({} bytes a parameter) exceed a GPU", _state_per_parameter),
    Check(
        TRAIN,
        "on {} GPUs the planner's first pick is {layout} without recompute ({} + {} GiB)",
        lambda: mixtral_on(16, ep=False),
    ),
    Check(TRAIN, "{layout} with ep {} first ({} + {} GiB)", lambda: mixtral_on(16, ep=True)[1:]),
    Check(
        TRAIN,
        "On {} GPUs nothing fits: the fp32 weights, gradients and AdamW moments alone are {} GiB per GPU "
        "(the smallest peak is {} GiB, {layout} with full recompute)",
        mixtral_on_8,
    ),
    Check(
        TRAIN,
        "Llama 2 7B at {}k, micro batch {}, global batch {}, bf16, needs {} + {} GiB per GPU as dp {} "
        "without recompute; the planner picks {layout}, {} + {} GiB, with {layout} at {} + {} GiB next; "
        "at {}k {layout}, {} + {} GiB;",
        longer_context,
    ),
    Check(
        TRAIN,
        "(tested to {} in fp32 at {} positions from a {}-position Llama",
        lambda: tuple(literals(CONTEXT_TEST)[k] for k in ("TOL", "LONG", "TRAINED")),
    ),
    Check(
        TRAIN, "times (default {}) over the original context kept, fewer than ({}) divided by", yarn_defaults
    ),
    Check(TRAIN, "(the default here is {})", _weight_decay),
    Check(
        TRAIN,
        "loss and gradients within {} and its weights after AdamW steps within {} (in fp32; with bf16 "
        "compute within {})",
        lambda: (EQ["REL"], EQ["ADAM_REL"], EQ["BF16_REL"]),
    ),
    Check(
        TRAIN,
        "(the loss with the router losses and every gradient within {}, the weights after {} AdamW steps "
        "within {})",
        lambda: (EQ["REL"], EQ["STEPS"], EQ["ADAM_REL"]),
    ),
    Check(
        TRAIN,
        "(loss and gradients within {}, the adapters after {} AdamW steps within {})",
        lambda: (EQ["REL"], EQ["STEPS"], EQ["ADAM_REL"]),
    ),
    Check(
        TRAIN,
        "(blocks of {} values, the scales in blocks of {}, as QLoRA",
        lambda: _nf4()[:2],
    ),
    Check(TRAIN, "scaler blocks ({} values for the full ones)", lambda: _nf4()[2:]),
    Check(TRAIN, "the loss and every adapter gradient within {}", lambda: (literals(QLORA_TEST)["REL"],)),
    Check(
        TRAIN,
        "log-likelihoods within {} or {} of their size",
        lambda: (literals(HARNESS_TEST)["TOL"], literals(HARNESS_TEST)["REL"]),
    ),
    Check(TRAIN, "{} s by default), then torchrun exits", lambda: (shutdown_timeout(),)),
    Check(TRAIN, "leaves on a stop signal within {} s", _stuck_s),
    Check(TRAIN, "more than {}x its peers' median and at least {} ms above it", _straggler),
    Check(TRAIN, "aborts at once, exit {}:", _aborted),
]


# --- the tests -------------------------------------------------------------------------------------


@functools.cache
def page(doc: str) -> str:
    return (ROOT / doc).read_text()


def unchecked(doc: str, text: str, checks: list[Check]) -> list[Figure]:
    """The page's figures that no check's phrase holds in one of its holes."""
    scanned = prose(text)
    held = [
        m.span(i)
        for c in checks
        if c.doc == doc
        for m in c.regex().finditer(scanned)
        for i in range(1, len(m.groups()) + 1)
    ]
    return [f for f in figures(doc, text) if not any(a <= f.start and f.end <= b for a, b in held)]


def test_every_figure_the_docs_quote_is_checked() -> None:
    problems = [f.report() for doc in SCANNED for f in unchecked(doc, page(doc), CHECKED)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("check", CHECKED, ids=[f"{c.doc}: {c.phrase[:48]}" for c in CHECKED])
def test_each_figure_is_what_the_code_gives(check: Check) -> None:
    assert check.doc in SCANNED, check.doc
    scanned = prose(page(check.doc))
    found = list(check.regex().finditer(scanned))
    assert found, (
        f"{check.doc}: the phrase {check.phrase!r} is not on the page (stale): make it the page's "
        "again, or remove its check with the figures"
    )
    want = check.values()
    for m in found:
        line = scanned.count("\n", 0, m.start()) + 1
        assert len(m.groups()) == len(want), (check.phrase, want)
        got = tuple(" ".join(g.split()) for g in m.groups())
        assert all(_same(g, w) for g, w in zip(got, want, strict=True)), (
            f"{check.doc}:{line}: the page says {got}, the code gives {want} (its phrase: {check.phrase!r})"
        )


def test_an_unregistered_figure_is_reported() -> None:
    """A guard for the extractor: a page with figures planted among what it must leave out."""
    planted = (
        "<!-- BEGIN tool --help: generated -->\n```text\n--gpu-memory 80GB\n```\n<!-- END tool --help -->\n"
        "A step takes 42 s and saves 3% on an H100; `--tp 99` and [it](../bench/12.md) are inputs;\n"
        "Llama 3.2, Qwen 2.5 and Falcon 40B are names, 1F1B a schedule; 2 processes, tp 2 × pp 4;\n"
        "a 1.1B model, 1e-4, 16k, 2×.\n\n```bash\nmega-train --steps 1000   # 1.5 GiB\n```\n"
    )
    found = figures("docs/planted.md", planted)
    assert [f.text for f in found] == ["42", "3", "1.1", "1e-4", "16", "2"], found
    report = found[0].report()
    assert report.startswith("docs/planted.md:6: '42' in ") and report.endswith(ADVICE), report
    takes = Check("docs/planted.md", "takes {} s and saves {}%", lambda: (42, 3))
    assert [f.text for f in unchecked("docs/planted.md", planted, [takes])] == ["1.1", "1e-4", "16", "2"]


def test_each_name_pattern_is_needed() -> None:
    """NAMES stays narrow: each pattern names something on a page (else it is stale)."""
    scanned = " ".join(prose(page(doc)) for doc in SCANNED)
    stale = [p for p in NAMES if not re.search(p, scanned)]
    assert not stale, stale


def test_the_mfu_table_names_every_gpu_of_the_peak_table() -> None:
    from mega_train.metrics import PEAK_TFLOPS

    assert sorted(k for keys, _ in MFU_ROWS for k in keys) == sorted(PEAK_TFLOPS)


def test_the_readme_tours_output_is_held_by_the_planner_test() -> None:
    """README's tour shows the dry run's output as `#` lines in its bash blocks, which this test
    does not scan: tests/train/test_planner.py's test holds them to what the dry run prints."""
    name = "test_the_readme_tour_prints_the_planners_plan"
    source = (ROOT / PLANNER_TEST).read_text()
    (test,) = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name]
    body = ast.get_source_segment(source, test)
    assert "from test_readme_tour import README as TOUR_README" in body and "tour(TOUR_README" in body
    assert (
        "for line in dry.printed" in body
        and 'README = Path(__file__).resolve().parents[1] / "README.md"' in (ROOT / TOUR_TEST).read_text()
    )
    tour = page("README.md").split(literals(TOUR_TEST)["SECTION"], 1)[1].split("\n## ", 1)[0]
    assert re.search(r"^# .*\d+\.\d GiB", tour, re.M), "README's tour shows no dry-run output to exempt"
