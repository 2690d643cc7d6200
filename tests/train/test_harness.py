"""lm-evaluation-harness on our checkpoints (mega_train/harness.py): on tasks defined here (YAMLs over
small JSON files: multiple choice, generation, rolling log-likelihood), the `mega` model through
lm-eval's own command line equals lm-eval's `hf` model on the checkpoint's export (accuracy exactly,
every log-likelihood within 1e-4, every generation), in one process and at tp 2 (`make test-slow`),
and on a LoRA adapter's checkpoint at tp 2 against the export of it merged; in a run the tasks are
scored at every evaluation; bad tasks, bad model arguments and lm-eval missing are one
line and exit 2 before anything runs. The console stays quiet (helpers.assert_quiet): our model's
lm-eval runs and a run with tasks, in one process and under its own launcher at tp 2 (LoRA
adapters with dropout, whose masks DTensor draws), all outside a git repository, leave only our
lines on stderr; `--debug` shows lm-eval's own again (make test-slow)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import BIN, assert_one_line_error, assert_quiet, run_in_process
from runlib import TINY_LLAMA, free_port, metrics, ok, train, write_run

TOL = 1e-4  # log-likelihoods, ours against transformers' (fp32)
REL = 1e-6  # or relative to their size: a rolling log-likelihood sums ~400 tokens' (|ll| ~ 400)
LIMIT = 5  # documents of each task (each has more)
TASKS = ["tiny_mc", "tiny_gen", "tiny_ppl"]
WORDS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh"]
YAML = {
    "tiny_mc": """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list: [{metric: acc}, {metric: acc_norm}]""",
    "tiny_gen": """output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs: {until: ["."], max_gen_toks: 8, do_sample: false}
metric_list: [{metric: exact_match}]""",
    "tiny_ppl": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list: [{metric: word_perplexity}, {metric: bits_per_byte}]""",
}


def write_tasks(root: Path) -> Path:
    """The three tasks' YAMLs and documents under `root`."""
    docs = {
        "tiny_mc": [{"question": f"Which words come after the {w} one?",
                     "choices": ["the cat", "a dog", "once upon", "there was"], "answer": i % 4}
                    for i, w in enumerate(WORDS)],
        "tiny_gen": [{"prompt": f"Once upon a time the {w}", "answer": "there"} for w in WORDS],
        "tiny_ppl": [{"text": f"The {w} little girl lived in a village near the forest."} for w in WORDS],
    }  # fmt: skip
    root.mkdir(parents=True, exist_ok=True)
    for task, rows in docs.items():
        (root / f"{task}.json").write_text(json.dumps(rows))
        head = f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / task}.json\n"
        (root / f"{task}.yaml").write_text(head + "test_split: test\n" + YAML[task] + "\n")
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tokens: Path) -> Path:
    """12 steps of a tiny Llama drawn wide (its greedy tokens differ by position), lm-eval's tasks
    scored in the run every 6 steps; its step-12 checkpoint exported."""
    root = tmp_path_factory.mktemp("harness")
    evals = {
        "every": 6,
        "iters": 2,
        "tasks": TASKS,
        "task_paths": [str(write_tasks(root / "tasks"))],
        "limit": LIMIT,
    }
    run_json = write_run(root, tokens, model={"config": TINY_LLAMA, "init_std": 0.5}, eval=evals)
    # Its own process (as a user runs it, its console quieted), outside a git repository.
    (root / "train.stderr").write_text(ok(train(run_json, fresh=True, cwd=root)).stderr)
    ok(run_in_process("mega-export", root / "run" / "checkpoints" / "step-00000012", root / "hf"))
    return root


def lm_eval(
    root: Path, out: str, model: str, model_args: str, nproc: int = 0, cwd: Path | None = None
) -> tuple[dict, dict]:
    """lm-eval's command line (ours: `python -m mega_train.harness`, under torchrun with `nproc`),
    run in `cwd` (default `root`); its results and its samples by task. Ours runs 4 requests a
    forward (rows of several lengths, right-padded), the hf model one (its batched generation counts
    left padding into its limit)."""
    batch = "1" if model == "hf" else "4"
    args = ["--model", model, "--model_args", model_args, "--tasks", ",".join(TASKS), "--include_path",
            str(root / "tasks"), "--limit", str(LIMIT), "--batch_size", batch, "--output_path", str(root / out),
            "--log_samples", "--device", "cpu"]  # fmt: skip
    if model == "hf":
        cmd = [str(BIN / "lm-eval"), *args]
    elif nproc:
        cmd = [str(BIN / "torchrun"), "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
               "-m", "mega_train.harness", *args]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "mega_train.harness", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=cwd or root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if model == "mega":
        assert_quiet(proc.stderr)
    (results,) = (root / out).glob("*/results_*.json")
    samples = {
        task: sorted(
            map(json.loads, next((root / out).glob(f"*/samples_{task}_*.jsonl")).open()),
            key=lambda r: r["doc_id"],
        )
        for task in TASKS
    }
    return json.loads(results.read_text())["results"], samples


def assert_same_scores(ours: tuple[dict, dict], theirs: tuple[dict, dict]) -> None:
    """Accuracy and exact match equal; every log-likelihood within TOL (or REL of its size); every generation equal."""
    (got, got_samples), (want, want_samples) = ours, theirs
    for metric in ("acc,none", "acc_norm,none"):
        assert got["tiny_mc"][metric] == want["tiny_mc"][metric], metric
    assert got["tiny_gen"]["exact_match,none"] == want["tiny_gen"]["exact_match,none"]
    for task in ("tiny_mc", "tiny_ppl"):
        assert len(got_samples[task]) == LIMIT
        for a, b in zip(got_samples[task], want_samples[task], strict=True):
            for (x,), (y,) in zip(a["resps"], b["resps"], strict=True):  # [logp, greedy] or logp
                x, y = (float(v[0] if isinstance(v, list) else v) for v in (x, y))
                assert math.isclose(x, y, rel_tol=REL, abs_tol=TOL), (task, a["doc_id"], x, y)
    gens = [
        (a["resps"], b["resps"])
        for a, b in zip(got_samples["tiny_gen"], want_samples["tiny_gen"], strict=True)
    ]
    assert all(a == b for a, b in gens), gens
    assert len({a[0][0] for a, _ in gens}) > 1, gens  # generations that tell models apart


@pytest.fixture(scope="module")
def hf_scores(trained: Path) -> tuple[dict, dict]:
    return lm_eval(trained, "out-hf", "hf", f"pretrained={trained / 'hf'},dtype=float32")


@pytest.mark.slow  # make test runs a LoRA adapter's model (at tp 2) against its export
def test_mega_model_equals_the_hf_model_on_the_export(trained: Path, hf_scores) -> None:
    ckpt = trained / "run" / "checkpoints" / "step-00000012"
    assert_same_scores(lm_eval(trained, "out-mega", "mega", f"pretrained={ckpt}"), hf_scores)


@pytest.mark.slow  # make test runs the adapter test at tp 2
@pytest.mark.dist
def test_mega_model_at_tp2_equals_the_hf_model_on_the_export(trained: Path, hf_scores) -> None:
    ckpt = trained / "run" / "checkpoints" / "step-00000012"
    assert_same_scores(lm_eval(trained, "out-tp2", "mega", f"pretrained={ckpt},tp=2", nproc=2), hf_scores)


@pytest.mark.dist
def test_mega_model_on_a_lora_adapter_equals_the_hf_model_on_its_merged_export(
    trained: Path, hf_scores, tokens: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter trained 4 steps on the step-12 checkpoint (the run started in its directory, its
    paths relative to it), scored at tp 2 from another directory on the base it names with its
    adapters applied as in training, equals lm-eval's `hf` model on mega-export's merge of it
    (`--base` a copy of the base, as when it moved; also from another directory), and differs from
    the base's scores."""
    import shutil

    base = trained / "run" / "checkpoints" / "step-00000012"
    lora = {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]}
    write_run(tmp_path, tokens, init=Path(os.path.relpath(base, tmp_path)), lora=lora, train_steps=4,
              optimizer={"lr": 3e-2}, checkpoint={"every": 4}, eval={"every": 0})  # fmt: skip
    monkeypatch.chdir(tmp_path)
    ok(train(Path("run.json")))
    adapter = tmp_path / "run" / "checkpoints" / "step-00000004"
    moved = shutil.copytree(base, tmp_path / "moved-base")
    elsewhere = write_tasks(tmp_path / "tasks")
    monkeypatch.chdir(elsewhere)
    ok(run_in_process("mega-export", adapter, tmp_path / "merged", "--base", moved))
    theirs = lm_eval(tmp_path, "out-hf", "hf", f"pretrained={tmp_path / 'merged'},dtype=float32")
    assert_same_scores(
        lm_eval(tmp_path, "out-mega", "mega", f"pretrained={adapter},tp=2", nproc=2, cwd=elsewhere), theirs
    )
    ppl = (
        [s["resps"][0][0] for s in theirs[1]["tiny_ppl"]],
        [s["resps"][0][0] for s in hf_scores[1]["tiny_ppl"]],
    )
    assert max(abs(float(a) - float(b)) for a, b in zip(*ppl, strict=True)) > 100 * TOL  # the adapter counts


def test_a_run_scores_the_tasks_at_every_evaluation(trained: Path, hf_scores) -> None:
    """`eval_task` records at steps 6 and 12, the last equal to lm-eval's on the export; the scores
    alone (no standard errors, no `sample_len`), and only our lines on stderr."""
    assert_quiet((trained / "train.stderr").read_text())
    rows = metrics(trained / "run", "eval_task")
    assert sorted({r["step"] for r in rows}) == [6, 12]
    scores = {"acc", "acc_norm", "exact_match", "word_perplexity", "bits_per_byte"}  # the YAMLs' metrics
    assert {r["metric"] for r in rows} == scores
    last = {(r["task"], r["metric"]): r["value"] for r in rows if r["step"] == 12}
    want = hf_scores[0]
    assert last["tiny_mc", "acc"] == want["tiny_mc"]["acc,none"]
    assert last["tiny_gen", "exact_match"] == want["tiny_gen"]["exact_match,none"]
    bpb = last["tiny_ppl", "bits_per_byte"], want["tiny_ppl"]["bits_per_byte,none"]
    assert math.isclose(*bpb, rel_tol=REL, abs_tol=1e-6)


@pytest.mark.dist
def test_a_launched_run_with_tasks_prints_only_our_lines(trained: Path, tmp_path: Path, tokens: Path) -> None:
    """`mega-train --nproc-per-node 2 --json` at tp 2 scoring lm-eval's tasks, outside a git
    repository, LoRA adapters with dropout on the step-12 checkpoint (masks drawn by DTensor's random
    ops, which warn on a CPU mesh): stderr holds our lines alone (the console, which --json sends
    there: no lm-eval bar, log line or git complaint, no DTensor warning from either rank), the
    scores among them, and the limit said once in our words."""
    evals = {"every": 2, "iters": 1, "tasks": ["tiny_mc"], "task_paths": [str(write_tasks(tmp_path / "tasks"))],
             "limit": 2}  # fmt: skip
    lora = {"rank": 4, "alpha": 8, "dropout": 0.1, "targets": ["q_proj", "v_proj", "down_proj"]}
    base = trained / "run" / "checkpoints" / "step-00000012"
    run_json = write_run(
        tmp_path, tokens, init=base, lora=lora, train_steps=2, parallel={"tp": 2}, eval=evals
    )
    proc = ok(train(run_json, "--nproc-per-node", "2", "--json", cwd=tmp_path))
    assert_quiet(proc.stderr)
    assert "step 2 eval tiny_mc | acc " in proc.stderr, proc.stderr
    assert "mega-train: eval.limit: lm-eval's tasks are scored on their first 2 documents" in proc.stderr


@pytest.mark.slow  # lm-eval's task index (13 s); make test: lm-eval missing, the same check's
def test_an_unknown_task_exits_2_before_any_worker(tmp_path: Path, tokens: Path) -> None:
    tasks = write_tasks(tmp_path / "tasks")
    run_json = write_run(
        tmp_path, tokens, eval={"every": 6, "tasks": ["tiny_mc", "tiny_nope"], "task_paths": [str(tasks)]}
    )
    proc = train(run_json, "--nproc-per-node", "2")
    assert_one_line_error(proc, "$.eval.tasks[1]: lm-eval knows no task 'tiny_nope'")
    assert not (tmp_path / "run").exists()


def test_lm_eval_not_installed_exits_2(tmp_path: Path, tokens: Path) -> None:
    """A Python where `import lm_eval` fails (its module entry None, as for a package not there)."""
    run_json = write_run(tmp_path, tokens, eval={"every": 6, "tasks": ["tiny_mc"]})
    code = (
        "import sys; sys.modules['lm_eval'] = None; from megacore.cli import run; "
        f"from mega_train.cli import app; sys.exit(run(app, 'mega-train', ['--manifest', {str(run_json)!r}]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert_one_line_error(proc, "$.eval.tasks: lm-evaluation-harness is not installed", "mega-train[eval]")


# lm-eval's command line with our model and no checkpoint (the tasks' directory last), and its line.
BAD_MODEL_ARGS = [sys.executable, "-m", "mega_train.harness", "--model", "mega", "--model_args", "tp=2",
                  "--tasks", "tiny_mc", "--include_path"]  # fmt: skip
NO_CHECKPOINT = "lm-eval (mega): error: --model_args: pretrained=DIR is required (a mega checkpoint artifact)"


@pytest.mark.slow  # a start of lm-eval's command line (10 s); make test: the arguments below
def test_bad_model_arguments_through_lm_evals_command_line_exit_2(trained: Path) -> None:
    """Through lm-eval's command line: one line, exit 2."""
    proc = subprocess.run([*BAD_MODEL_ARGS, str(trained / "tasks")], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)  # fmt: skip
    assert_one_line_error(proc, NO_CHECKPOINT)


def test_bad_model_arguments_are_checked_before_a_model_is_built(trained: Path) -> None:
    """Each argument checked before a model is built, one line each."""
    from mega_train.harness import MegaLM
    from megacore.errors import UserError

    ckpt = trained / "run" / "checkpoints" / "step-00000012"
    for args, said in ((",pp=x", "pp=x: expected a positive integer"), (",precision=fp64", "precision=fp64"),
                       (",vocab=3", "unknown model argument 'vocab'"),
                       (",base=/nowhere", "is not a LoRA adapter; it has no base")):  # fmt: skip
        with pytest.raises(UserError, match=said):
            MegaLM.create_from_arg_string(f"pretrained={ckpt}{args}")


@pytest.mark.slow  # a second start of lm-eval's command line (14 s); make test runs the quiet one
def test_debug_shows_lm_evals_own_lines(tmp_path: Path) -> None:
    """`--debug` (taken out of lm-eval's arguments) silences nothing: lm-eval's own log lines, the
    traceback, then our line."""
    env = {k: v for k, v in os.environ.items() if k != "LMEVAL_LOG_LEVEL"} | {"OMP_NUM_THREADS": "1"}
    cmd = [*BAD_MODEL_ARGS, str(write_tasks(tmp_path / "tasks")), "--debug"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == NO_CHECKPOINT, proc.stderr[-2000:]
    assert "Selected Tasks" in proc.stderr and "Traceback" in proc.stderr, proc.stderr[-2000:]
