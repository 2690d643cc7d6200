"""README.md's "A 5-minute tour" runs as written (issue #21): its ```bash blocks' commands, in order,
with its ```json block as run.json, in a fresh directory with this venv's tools first on PATH.

Only what names the reader's own inputs and scale is replaced, each by an explicit rule below that
must still apply: `Mistral-7B-v0.1` is a tiny transformers Llama directory of that name (with a real
tokenizer: the tests' SentencePiece BPE, and the tokenizer.json transformers converts from it, as the
hub ships Mistral), `corpus/*.jsonl.zst` a small zstd jsonl corpus there, `--nproc-per-node` the
world size of run.json's layout (tp x pp, dp 1) and run.json's scale fields a few short steps. A
command that needs the network or a secret is skipped by a rule naming it (SKIP), never silently.
The tour changing shape fails the test, naming what it does not know: a block other than bash or
json, a command of an unknown program, a run.json key without a rule, a rule that no longer applies.
The `#` lines under a command are its output as printed (the dry run's: tests/train/test_planner.py
holds them to the planner's by value); here the same shape (SHAPES), not the numbers, must be in
what the tour's run prints, and the commands without `#` lines print what the README says they do
(ALSO_PRINTS).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers import BIN
from tokenize_testlib import corpus, write_jsonl

README = Path(__file__).resolve().parents[1] / "README.md"
SECTION = "## A 5-minute tour"

# The reader's own inputs, made in the tour's directory under the names the tour gives them.
MODEL = "Mistral-7B-v0.1"
CORPUS = "corpus/*.jsonl.zst"
# The programs the tour may run; any other fails the test (it would not know what it needs).
PROGRAMS = {"mega-tokenize", "mega-convert", "mega-shard", "mega-train", "mega-export", "python"}
# Commands not run, each with why; every rule must match exactly one command of the tour.
SKIP = [
    (
        re.compile(r"^HF_TOKEN=\S+ mega-export .*--push-to-hub(?!.*--dry-run)"),
        "publishes to the Hugging Face Hub: needs the network and a token (the --dry-run line before it runs)",
    ),
]
# run.json: the fields that set the run's scale, made a few short steps (each must be in the tour's
# run.json); every other field is run as written and must be one of KEPT.
SCALE = {
    ("batch", "global_batch_size"): 4,  # micro 1 x dp 2 (8 GPUs) x pp 2 microbatches
    ("batch", "seq_length"): 32,
    ("train_steps",): 2,
    ("optimizer", "warmup_steps"): 1,
    ("checkpoint", "every"): 2,
    ("eval", "every"): 2,
    ("eval", "iters"): 1,
}
KEPT = {
    ("kind",), ("format_version",), ("out",), ("model", "init"), ("data", "sources"), ("data", "split"),
    ("batch", "micro_batch_size"), ("parallel", "tp"), ("parallel", "pp"), ("precision",),
    ("optimizer", "lr"),
}  # fmt: skip
# Shapes of printed lines: each must match one of the tour's `#` lines under a command of that
# program (else the README changed and the shape here is stale) and a line that command prints.
NUM = r"[\d,]+(?:\.\d+)?(?:e[+-]?\d+)?"
SHAPES = {
    "mega-train --dry-run": [
        rf"^run\.json: ok — \w+ {NUM} layers \({NUM}[BM]? parameters\); world {NUM} = tp {NUM} x pp {NUM} x dp {NUM}; batch {NUM} = micro {NUM} x dp {NUM} x accum {NUM}; 1 data source; {NUM} steps$",
        r"^memory per rank, GiB \(",
        rf"^  peak {NUM} GiB \+ {NUM} GiB allowance = {NUM} GiB per GPU, of {NUM} GiB: fits$",
        rf"^layouts of {NUM} GPUs of {NUM} GiB, by expected throughput",
        rf"^  1\. tp {NUM} x pp {NUM} x dp {NUM}, recompute \w+ +peak +{NUM} GiB +throughput {NUM}$",
    ],
}
# What commands the tour shows no output of print (checked against their output only): what the
# README says they print (a line every logging step, eval lines, checkpoints; a verdict).
ALSO_PRINTS = {
    "mega-tokenize": [
        rf"^mega-tokenize: \S+: {NUM} documents, {NUM} tokens \(uint\d+\), {NUM} skipped lines, engine \S+, {NUM}s, {NUM} MB/s$",
    ],
    "mega-convert verify": [
        rf"^{NUM} tokens compared in \w+, .*: max abs logit error {NUM} \(tolerance {NUM}\), .*: PASS$",
    ],
    "mega-train": [
        rf"^step {NUM}/{NUM} \| loss {NUM} \| lr {NUM} \| grad norm {NUM} \|",
        rf"^step {NUM} eval \| loss {NUM} \| ppl {NUM} \| accuracy {NUM}$",
        r"^mega-train: saved \S+/checkpoints/step-\d+$",
    ],
    "mega-export --dry-run": [r"^would upload to me/\S+ \(main\):$", rf"^ +{NUM} +model\.safetensors$"],
}


@dataclass
class Command:
    line: str  # as written in the README
    printed: list[str] = field(default_factory=list)  # its `#` lines, without the `# `

    @property
    def program(self) -> str:
        words = [w for w in shlex.split(self.line, comments=True) if not re.match(r"^\w+=", w)]
        return words[0] if words else ""

    @property
    def kind(self) -> str:
        """The SHAPES key: the program, with the subcommand or flag its output depends on."""
        words = shlex.split(self.line, comments=True)
        if self.program == "mega-convert":
            return f"mega-convert {words[1]}"
        if self.program in ("mega-train", "mega-export") and "--dry-run" in words:
            return f"{self.program} --dry-run"
        return self.program


def tour(text: str) -> tuple[list[Command], dict]:
    """The tour's commands in `text` (README.md) in order, their printed lines attached, and its
    run.json; fails on any block or program it does not know."""
    assert text.count(f"\n{SECTION}\n") == 1, f"README.md: no single `{SECTION}` section"
    section = text.split(f"\n{SECTION}\n", 1)[1].split("\n## ", 1)[0]
    commands: list[Command] = []
    runs: list[dict] = []
    for lang, body in re.findall(r"^```(\S*)\n(.*?)^```", section, re.S | re.M):
        if lang == "json":
            runs.append(json.loads(body))
        elif lang == "bash":
            for line in body.splitlines():
                if line.startswith("#"):
                    assert commands, f"README tour: output line before any command: {line!r}"
                    commands[-1].printed.append(line.removeprefix("#").removeprefix(" "))
                elif line.strip():
                    assert not line.rstrip().endswith("\\"), f"README tour: continued line: {line!r}"
                    commands.append(Command(line.strip()))
        else:
            pytest.fail(f"README tour: a ```{lang} block; the test runs only bash and json blocks:\n{body}")
    assert len(runs) == 1, f"README tour: {len(runs)} json blocks; the test expects one, its run.json"
    unknown = [c.line for c in commands if c.program not in PROGRAMS]
    assert not unknown, f"README tour: commands the test does not know how to run: {unknown}"
    return commands, runs[0]


def _leaves(d: dict, prefix: tuple = ()) -> list[tuple]:
    """The key paths of run.json's fields (a dict that SCALE or KEPT names is one field)."""
    out = []
    for k, v in d.items():
        key = (*prefix, k)
        if isinstance(v, dict) and key not in SCALE.keys() | KEPT:
            out += _leaves(v, key)
        else:
            out.append(key)
    return out


def scaled_run(run: dict) -> dict:
    """The tour's run.json with SCALE applied; fails on a field neither SCALE nor KEPT knows."""
    leaves = set(_leaves(run))
    unknown = sorted(leaves - SCALE.keys() - KEPT)
    assert not unknown, (
        f"README tour: run.json fields the test has no rule for (add to SCALE or KEPT): {unknown}"
    )
    missing = sorted(SCALE.keys() - leaves)
    assert not missing, f"README tour: run.json no longer has {missing}; update SCALE"
    run = json.loads(json.dumps(run))
    for keys, value in SCALE.items():
        d = run
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
    return run


def substitute(cmd: Command, world: int) -> str:
    """The command as run: its world size the layout's (the only flag rewritten)."""
    line, n = re.subn(r"--nproc-per-node \d+", f"--nproc-per-node {world}", cmd.line)
    assert n <= 1, cmd.line
    return line


def make_inputs(root: Path, sp_model: Path) -> None:
    """MODEL: a tiny random Llama (2 layers, hidden 64, GQA; the tokenizer's vocab) with a model
    card and the tokenizer files Mistral ships (tokenizer.model, tokenizer.json, tokenizer_config);
    CORPUS: 200 documents of real text in one zstd jsonl."""
    import torch
    import transformers
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    transformers.logging.disable_progress_bar()
    src = root / "sp"
    src.mkdir()
    (src / "tokenizer.model").write_bytes(sp_model.read_bytes())
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    tok = AutoTokenizer.from_pretrained(src)
    model = root / MODEL
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(model)
    tok.save_pretrained(model)
    (model / "tokenizer.model").write_bytes(sp_model.read_bytes())
    (model / "README.md").write_text("---\nlicense: apache-2.0\n---\n# A tiny random Llama\n")
    (root / "corpus").mkdir()
    write_jsonl(root / "corpus" / "part-000.jsonl.zst", [{"text": t} for t in corpus(200)], compress="zst")


def check_shapes(kind: str, commands: list[Command], printed: str) -> None:
    lines = printed.splitlines()
    documented = [p for c in commands if c.kind == kind for p in c.printed]
    for shape in SHAPES.get(kind, []):
        assert any(re.search(shape, p) for p in documented), (
            f"README tour: no `#` line of `{kind}` has the shape {shape!r} (the README changed?)",
            documented,
        )
    for shape in SHAPES.get(kind, []) + ALSO_PRINTS.get(kind, []):
        assert any(re.search(shape, p) for p in lines), (
            f"`{kind}` printed no line of the shape {shape!r}",
            printed[-4000:],
        )


@pytest.mark.dist
def test_readme_tour_runs_as_written(tmp_path: Path, sp_model: Path) -> None:
    commands, run = tour(README.read_text())
    assert len(commands) >= 10, [c.line for c in commands]  # not an empty or truncated tour
    section = " ".join(c.line for c in commands)
    for name in (MODEL, f"'{CORPUS}'", "run.json"):
        assert name in section, f"README tour: no longer names {name}; update the test's inputs"
    launches = [c.line for c in commands if "--nproc-per-node" in c.line]
    assert len(launches) == 1, f"README tour: the test sets --nproc-per-node of one command: {launches}"
    gone = (SHAPES.keys() | ALSO_PRINTS.keys()) - {c.kind for c in commands}
    assert not gone, f"README tour: no longer runs {sorted(gone)}; update SHAPES / ALSO_PRINTS"

    run = scaled_run(run)
    tp, pp = run["parallel"]["tp"], run["parallel"]["pp"]
    make_inputs(tmp_path, sp_model)
    (tmp_path / "run.json").write_text(json.dumps(run, indent=1) + "\n")

    skipped = {i: [c.line for c in commands if rule.search(c.line)] for i, (rule, _) in enumerate(SKIP)}
    assert all(len(m) == 1 for m in skipped.values()), f"SKIP rules must each match one command: {skipped}"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline"}  # fmt: skip
    env.pop("HF_TOKEN", None)  # what runs here runs without one
    for cmd in commands:
        why = next((why for rule, why in SKIP if rule.search(cmd.line)), None)
        if why is not None:
            print(f"skipped: {cmd.line}\n  ({why})")
            continue
        line = substitute(cmd, tp * pp)
        start = time.monotonic()
        proc = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        print(f"{time.monotonic() - start:5.1f}s  {line}")  # shown with -s, or on a failure
        assert proc.returncode == 0, (line, proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
        check_shapes(cmd.kind, commands, proc.stdout + proc.stderr)

    from megacore.artifacts import open_artifact

    for path, kind in [("out/tokens", "tokens"), ("out/ckpt", "checkpoint"), ("out/ckpt-tp2pp2", "checkpoint"),
                       ("out/run/checkpoints/latest", "checkpoint"), ("out/hf", "hf")]:  # fmt: skip
        open_artifact(tmp_path / path, kind)
    steps = run["train_steps"]
    assert (tmp_path / "out/run/checkpoints/latest").resolve().name == f"step-{steps:08d}"
    assert (tmp_path / "out/hf/tokenizer.json").is_file() and (tmp_path / "out/hf/README.md").is_file()


TOUR_CHANGES = {
    "a new kind of block": ("**5. Export**", "```python\nprint(1)\n```\n\n**5. Export**"),
    "an unknown program": ("mega-shard out/ckpt", "docker run megatron\nmega-shard out/ckpt"),
    "a run.json field without a rule": (
        '"precision": "bfloat16",',
        '"precision": "bfloat16", "attention": "flash",',
    ),
    "a scale field gone": (', "iters": 10}', "}"),
    "a second run.json": ("**4. Train**", "```json\n{}\n```\n\n**4. Train**"),
    "no tour": ("## A 5-minute tour", "## A tour"),
}
FAILS_WITH = {
    "a new kind of block": "a ```python block",
    "an unknown program": "commands the test does not know how to run: ['docker run megatron']",
    "a run.json field without a rule": "[('attention',)]",
    "a scale field gone": "run.json no longer has [('eval', 'iters')]",
    "a second run.json": "2 json blocks",
    "no tour": "no single `## A 5-minute tour` section",
}


@pytest.mark.parametrize("change", TOUR_CHANGES)
def test_a_tour_the_test_does_not_know_fails_naming_what(change: str) -> None:
    """The extraction (no command run) fails on a tour it does not know how to run, naming why."""
    old, new = TOUR_CHANGES[change]
    text = README.read_text()
    assert text.count(old) == 1, f"README.md changed: update TOUR_CHANGES[{change!r}]"
    with pytest.raises((AssertionError, pytest.fail.Exception)) as e:
        scaled_run(tour(text.replace(old, new))[1])
    assert FAILS_WITH[change] in str(e.value), str(e.value)
