"""examples/Makefile end to end on tiny inputs: a corpus, a SentencePiece tokenizer and a tiny Llama
from transformers become tokens, a converted and resharded checkpoint, a training run under torchrun
and an export (whose card carries the source's license); a rerun does nothing; a changed corpus rebuilds the tokens, the run (the old one
kept aside) and the export, and leaves the converted checkpoints alone."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import BIN
from tokenize_testlib import corpus, write_jsonl

MAKEFILE = Path(__file__).resolve().parents[1] / "examples" / "Makefile"


def make(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    cmd = ["make", "-f", str(MAKEFILE), "CORPUS=corpus.jsonl", "TOKENIZER=tok.model", "HF_MODEL=hf",
           "OUT=out", "TP=2", "PP=1", "NPROC=2", "STEPS=3", "SEQ=32", "BATCH=4", *args]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
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
    for tool in ("mega-tokenize", "mega-convert hf", "mega-shard", "torchrun", "mega-export"):
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
    assert not any(t in again.stdout for t in ("mega-", "torchrun")), again.stdout

    write_jsonl(tmp_path / "corpus.jsonl", [{"text": t} for t in corpus(150)])  # the data changed
    third = make(tmp_path)
    for tool in ("mega-tokenize", "torchrun", "mega-export"):
        assert tool in third.stdout, tool
    assert "mega-convert hf" not in third.stdout and "mega-shard" not in third.stdout
    assert "inputs changed: the previous run is kept as" in third.stdout
    assert len(list(out.glob("run.before-*"))) == 1  # kept, not deleted
    for p in ("ckpt", "ckpt-tp2pp1"):
        assert (out / p / "manifest.json").stat().st_mtime_ns == done[p], p
    for p in ("tokens", "hf"):
        assert (out / p / "manifest.json").stat().st_mtime_ns > done[p], p


def test_airflow_dag_loads_with_airflows_own_loader() -> None:
    """Runs where apache-airflow is installed (not a dependency of this project)."""
    pytest.importorskip("airflow")
    from airflow.models import DagBag

    bag = DagBag(dag_folder=str(MAKEFILE.parent / "airflow"))  # Airflow 3 (2 loaded its examples too)
    assert not bag.import_errors, bag.import_errors
    dag = bag.dags["mega_chain"]  # as parsed (get_dag would ask the metadata database)
    assert {t.task_id for t in dag.tasks} == {"tokenize", "convert", "shard", "train", "export"}
    assert dag.get_task("shard").upstream_task_ids == {"convert"}
    assert dag.get_task("train").upstream_task_ids == {"tokenize", "shard"}
    assert dag.get_task("export").upstream_task_ids == {"train"}
    assert "ti.xcom_pull(task_ids='train')" in dag.get_task("export").bash_command
    assert "mega-train) --manifest $run --json" in dag.get_task("train").bash_command


def test_airflow_dag_runs_the_chain(tmp_path: Path, sp_model: Path) -> None:
    """`airflow dags test` runs the DAG end to end on tiny inputs (where apache-airflow is
    installed, with the tools on PATH): every task succeeds, each hands the next its artifact's
    path, and the export is the trained checkpoint's, its card carrying the source's license."""
    pytest.importorskip("airflow")
    import json
    import sys

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
    (home / "dags").mkdir(parents=True)
    shutil.copy(MAKEFILE.parent / "airflow" / "mega_chain.py", home / "dags")
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}  # fmt: skip
    airflow = str(Path(sys.executable).parent / "airflow")
    conf = {"corpus": str(tmp_path / "corpus.jsonl"), "tokenizer": str(sp_model), "hf_model": str(tmp_path / "hf"),
            "out": str(tmp_path / "chain"), "tp": 2, "pp": 1, "nproc": 2, "steps": 3}  # fmt: skip
    (tmp_path / "chain").mkdir()
    for cmd in ([airflow, "db", "migrate"], [airflow, "dags", "reserialize"],
                [airflow, "dags", "test", "mega_chain", "--conf", json.dumps(conf)]):  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, (cmd, proc.stdout[-3000:], proc.stderr[-3000:])
    finished = [line for line in (proc.stdout + proc.stderr).splitlines() if "DagRun Finished" in line]
    assert len(finished) == 1 and " state=success," in finished[0], (proc.stdout[-3000:], proc.stderr[-3000:])
    final = tmp_path / "chain" / "run" / "checkpoints" / "step-00000003"
    export = open_artifact(tmp_path / "chain" / "hf", "hf")
    assert [Path(p.path).resolve() for p in export.parents] == [final.resolve()]
    assert ModelCard.load(tmp_path / "chain" / "hf" / "README.md").data.license == "apache-2.0"
