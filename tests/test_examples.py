"""examples/Makefile end to end on tiny inputs: a corpus, a SentencePiece tokenizer and a tiny Llama
from transformers become tokens, a converted and resharded checkpoint, a training run under torchrun
and an export (whose card carries the source's license); a rerun does nothing; a changed corpus rebuilds the tokens, the run (the old one
kept aside) and the export, and leaves the converted checkpoints alone; every tool's stderr holds
only its own lines (the quiet console, helpers.assert_quiet). The Airflow DAG, examples/instruct.json
on what `make demo` writes, and `make demo` itself as quiet (make test-slow)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import BIN, assert_quiet, run_in_process, run_tool, write_checkpoint
from tokenize_testlib import corpus, write_jsonl

MAKEFILE = Path(__file__).resolve().parents[1] / "examples" / "Makefile"


def make(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    cmd = ["make", "-f", str(MAKEFILE), "CORPUS=corpus.jsonl", "TOKENIZER=tok.model", "HF_MODEL=hf",
           "OUT=out", "TP=2", "PP=1", "NPROC=2", "STEPS=3", "SEQ=32", "BATCH=4", *args]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert_quiet(proc.stderr)  # mega-tokenize, -convert, -shard, -train --nproc-per-node 2, -export
    return proc


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_makefile_chain_reruns_only_what_changed(tmp_path: Path, sp_model: Path) -> None:
    import torch
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    shutil.copy(sp_model, tmp_path / "tok.model")
    write_jsonl(tmp_path / "corpus.jsonl", [{"text": t} for t in corpus(200)])
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=416, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "README.md").write_text(
        "---\nlicense: other\nlicense_name: tiny-license\n---\n# tiny\n"
    )

    first = make(tmp_path)
    for tool in ("mega-tokenize", "mega-convert hf", "mega-shard", "mega-train", "mega-export"):
        assert tool in first.stdout, tool
    out = tmp_path / "out"
    AutoModelForCausalLM.from_pretrained(out / "hf")  # transformers loads the end of the chain
    # The source's license, carried by convert, shard and train, is on the card as the Hub reads it.
    card = ModelCard.load(out / "hf" / "README.md").data
    assert (card.license, card.license_name) == ("other", "tiny-license")
    done = {
        p: (out / p / "manifest.json").stat().st_mtime_ns for p in ("ckpt", "ckpt-tp2pp1", "tokens", "hf")
    }

    again = make(tmp_path)  # up to date: no tool runs
    assert "mega-" not in again.stdout, again.stdout

    write_jsonl(tmp_path / "corpus.jsonl", [{"text": t} for t in corpus(150)])  # the data changed
    third = make(tmp_path)
    for tool in ("mega-tokenize", "mega-train", "mega-export"):
        assert tool in third.stdout, tool
    assert "mega-convert hf" not in third.stdout and "mega-shard" not in third.stdout
    assert "inputs changed: the previous run is kept as" in third.stdout
    assert len(list(out.glob("run.before-*"))) == 1  # kept, not deleted
    for p in ("ckpt", "ckpt-tp2pp1"):
        assert (out / p / "manifest.json").stat().st_mtime_ns == done[p], p
    for p in ("tokens", "hf"):
        assert (out / p / "manifest.json").stat().st_mtime_ns > done[p], p


@pytest.mark.slow  # the whole demo, 85 s (its tools run in make test: the Makefile chain above)
def test_make_demo_prints_only_our_lines(tmp_path: Path) -> None:
    """`make demo`'s command (examples/demo.py) end to end: its own model building (transformers,
    which imports torchao) and every tool it runs, tp 2 x pp 2 under torchrun, leave only our lines
    on stderr; its summary closes it."""
    demo = MAKEFILE.parent / "demo.py"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([sys.executable, str(demo), str(tmp_path / "demo-out")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "demo: done" in proc.stdout, proc.stdout[-3000:]
    assert_quiet(proc.stderr)


# Airflow is no dependency of this project: `make airflow-venv` installs it (requirements-airflow.txt)
# into a venv of its own, which the Makefile exports as MEGA_AIRFLOW_VENV; the DAG's tasks run the
# tools from the venv running the tests (BIN, first on their PATH).
AIRFLOW_VENV = "MEGA_AIRFLOW_VENV"


@pytest.fixture
def airflow_venv() -> Path:
    """The Airflow venv `make airflow-venv` built; skips outside make (no MEGA_AIRFLOW_VENV) and
    where the install failed (naming pip's error), fails where the variable names no such venv."""
    where = os.environ.get(AIRFLOW_VENV)
    if not where:
        pytest.skip(
            f"needs Airflow: run by `make test`, or set {AIRFLOW_VENV} to what `make airflow-venv` builds"
        )
    venv = Path(where)
    failed = venv / ".install-failed"
    if failed.is_file():
        pytest.skip(
            f"`make airflow-venv` could not install Airflow into {venv}: {failed.read_text().strip()}"
        )
    assert (venv / "bin" / "airflow").is_file(), (
        f"{AIRFLOW_VENV}={venv}: no bin/airflow; run `make airflow-venv`"
    )
    return venv


def airflow_env(home: Path) -> dict[str, str]:
    """Airflow's environment for a test: its home (config, sqlite database) in the test's directory,
    no example DAGs, this venv's tools first on PATH."""
    home.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}  # fmt: skip


# Run by the Airflow venv's python: the DAG as Airflow's own loader parses it, as JSON.
LOAD_DAG = """
import json, sys
from airflow.models import DagBag
bag = DagBag(dag_folder=sys.argv[1])  # Airflow 3 (2 loaded its examples too)
dag = bag.dags.get("mega_chain")  # as parsed (get_dag would ask the metadata database)
print(json.dumps({
    "import_errors": {str(k): str(v) for k, v in bag.import_errors.items()},
    "tasks": dag and {t.task_id: {"upstream": sorted(t.upstream_task_ids), "bash_command": t.bash_command}
                      for t in dag.tasks},
}))
"""


def test_airflow_dag_loads_with_airflows_own_loader(tmp_path: Path, airflow_venv: Path) -> None:
    """Airflow's DagBag, in the Airflow venv, loads the DAG without import errors: its tasks, their
    order, and the XCom and --json hand-offs in the commands."""
    import json

    proc = subprocess.run(
        [str(airflow_venv / "bin" / "python"), "-c", LOAD_DAG, str(MAKEFILE.parent / "airflow")],
        env=airflow_env(tmp_path / "airflow"), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    bag = json.loads(proc.stdout.splitlines()[-1])
    assert not bag["import_errors"], bag["import_errors"]
    tasks = bag["tasks"]
    assert tasks is not None, "no DAG mega_chain"
    assert set(tasks) == {"tokenize", "convert", "shard", "train", "export"}
    assert tasks["shard"]["upstream"] == ["convert"]
    assert tasks["train"]["upstream"] == ["shard", "tokenize"]
    assert tasks["export"]["upstream"] == ["train"]
    assert "ti.xcom_pull(task_ids='train')" in tasks["export"]["bash_command"]
    assert "mega-train) --manifest $run --json" in tasks["train"]["bash_command"]


@pytest.mark.slow  # 42 s; in make test: the DAG's structure (above) and the same tools' chain by make
def test_airflow_dag_runs_the_chain(tmp_path: Path, sp_model: Path, airflow_venv: Path) -> None:
    """`airflow dags test` runs the DAG end to end on tiny inputs (Airflow from its venv, the tools
    from this one on PATH): every task succeeds, each hands the next its artifact's path, and the
    export is the trained checkpoint's, its card carrying the source's license."""
    import json

    import torch
    from huggingface_hub import ModelCard
    from transformers import LlamaConfig, LlamaForCausalLM

    from megacore.artifacts import open_artifact

    write_jsonl(tmp_path / "corpus.jsonl", [{"text": t} for t in corpus(600)])
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=416, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    home = tmp_path / "airflow"
    env = airflow_env(home)
    (home / "dags").mkdir()
    shutil.copy(MAKEFILE.parent / "airflow" / "mega_chain.py", home / "dags")
    airflow = str(airflow_venv / "bin" / "airflow")
    conf = {"corpus": str(tmp_path / "corpus.jsonl"), "tokenizer": str(sp_model), "hf_model": str(tmp_path / "hf"),
            "out": str(tmp_path / "chain"), "tp": 2, "pp": 1, "nproc": 2, "steps": 3}  # fmt: skip
    (tmp_path / "chain").mkdir()
    for cmd in ([airflow, "db", "migrate"], [airflow, "dags", "reserialize"],
                [airflow, "dags", "test", "mega_chain", "--conf", json.dumps(conf)]):  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (cmd, proc.stdout[-3000:], proc.stderr[-3000:])
    finished = [line for line in (proc.stdout + proc.stderr).splitlines() if "DagRun Finished" in line]
    assert len(finished) == 1 and " state=success," in finished[0], (proc.stdout[-3000:], proc.stderr[-3000:])
    final = tmp_path / "chain" / "run" / "checkpoints" / "step-00000003"
    export = open_artifact(tmp_path / "chain" / "hf", "hf")
    assert [Path(p.path).resolve() for p in export.parents] == [final.resolve()]
    assert ModelCard.load(tmp_path / "chain" / "hf" / "README.md").data.license == "apache-2.0"


def test_instruct_and_lora_examples_plan_on_what_make_demo_writes(tmp_path: Path, sp_model: Path) -> None:
    """examples/instruct.json, examples/lora.json, examples/dpo.json and examples/grpo.json (on prompts
    tokenized beside them) after `make demo`: their data is the demo's chat and pair tokens (made here by the demo's own steps, with the tests' tokenizer)
    and their init a tp 2 x pp 2
    checkpoint where the demo writes one (here of random weights; the whole demo takes a minute);
    the dry runs pass. The LoRA chain run to the end (PEFT answering from the exported adapter):
    tests/train/test_instruct.py."""
    import importlib.util

    import torch

    from megacore.config import ModelConfig
    from megacore.parts import model_tensors

    spec = importlib.util.spec_from_file_location("demo", MAKEFILE.parent / "demo.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    out = tmp_path / "demo-out"
    out.mkdir()
    demo.pair_tokens(out, sp_model)  # the chat tokens too
    config = ModelConfig(family="llama", vocab_size=400, hidden_size=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, ffn_hidden_size=64, max_seq_len=256)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    write_checkpoint(
        tmp_path / "ckpt",
        {n: torch.randn(s, generator=g) for n, s in model_tensors(config).items()},
        config=config,
    )
    run_tool("mega-shard", tmp_path / "ckpt", out / "ckpt-tp2pp2", "--tp", "2", "--pp", "2", check=True)
    (tmp_path / "examples").mkdir()
    for name in ("instruct.json", "lora.json", "dpo.json"):  # lora.json: adapters on the same data
        if name == "dpo.json":  # it starts from instruct.json's run: its newest checkpoint, `latest`
            (tmp_path / "runs" / "instruct" / "checkpoints").mkdir(parents=True)
            (tmp_path / "runs" / "instruct" / "checkpoints" / "latest").symlink_to(out / "ckpt-tp2pp2")
        shutil.copy(MAKEFILE.parent / name, tmp_path / "examples")
        proc = run_in_process(
            "mega-train", "--manifest", tmp_path / "examples" / name, "--dry-run", "--world-size", "2"
        )
        assert proc.returncode == 0, (proc.stdout, proc.stderr)
        assert f"{name}: ok" in proc.stdout and "world 2 = tp 2 x pp 1 x dp 1" in proc.stdout, proc.stdout
        if name == "lora.json":
            assert "trained in LoRA adapters" in proc.stdout, proc.stdout
    assert "objective dpo" in proc.stdout and "batch 16 pairs" in proc.stdout, proc.stdout
    # grpo.json: on prompts made as its docs say (mega-tokenize --format prompts), its reward file beside it.
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    run_tool("mega-tokenize", write_jsonl(tmp_path / "prompts.jsonl", rows), out / "prompts-tokens",
             "-t", sp_model, "--format", "prompts", check=True)  # fmt: skip
    for name in ("grpo.json", "rewards.py"):
        shutil.copy(MAKEFILE.parent / name, tmp_path / "examples")
    proc = run_in_process(
        "mega-train", "--manifest", tmp_path / "examples" / "grpo.json", "--dry-run", "--world-size", "2"
    )
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "batch 8 prompts x 8 completions" in proc.stdout and "rewards.py:digits_only x 0.1" in proc.stdout
