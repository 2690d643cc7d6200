"""No number in README.md or docs/*.md that a test does not regenerate or check by value: every
figure the pages quote in prose is registered in CHECKED, keyed by its page and its phrase, with a
function that computes the figure from the code's own constants or output (the planner run as the
page states it, a default read off the tool, a bound imported from the test that holds it: those
functions are tests/doc_figures.py's).

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
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from doc_figures import (
    CONTEXT_TEST,
    EQUIVALENCE_WORKER,
    FP8_TEST,
    HARNESS_TEST,
    MFU_ROWS,
    PLANNER_TEST,
    QLORA_TEST,
    TOUR_TEST,
    _aborted,
    _compile_auto,
    _gpu_memory,
    _nf4,
    _shard_size,
    _state_per_parameter,
    _stop_codes,
    _straggler,
    _stuck_s,
    _tolerances,
    _weight_decay,
    allowance,
    flops_coefficients,
    fp8_capability,
    largest_uint16_vocab,
    literals,
    longer_context,
    lora_row,
    mixtral_counts,
    mixtral_on,
    mixtral_on_8,
    moe_row,
    pad_multiple,
    peak_tflops,
    planner_test,
    shutdown_timeout,
    table_row,
    yarn_defaults,
)

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
    r"Qwen \d(?:\.\d)?(?: / \d(?:\.\d)?)*(?: \d+B)?",  # Qwen 2.5, Qwen 2 / 2.5 / 3, Qwen 3.5 27B
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

# a layout as the pages write it: tp 1 × pp 2 × cp 4, and expert parallel after: "with ep 2"
LAYOUT = r"tp \d+(?:\s+×\s+(?:pp|cp|dp)\s+\d+)*(?:\s+with\s+ep\s+\d+)?"


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
        for name in planner_test("MOE_MODELS")
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
