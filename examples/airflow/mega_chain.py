"""The chain as an Airflow DAG: one task per tool, each handing the next the path of the artifact
it wrote (the `out` of its `--json` summary, the last line of its output: the task's XCom).

    tokenize ─┐
    convert ── shard ── train ── export

Trigger it with the paths as params (`airflow dags trigger mega_chain --conf '{...}'`): `corpus`,
`tokenizer`, `hf_model` (a Hugging Face model directory to fine-tune), `out` (a directory for the
artifacts), `tp`, `pp`, `nproc` (processes of the training task, one per GPU) and `steps`. The
tools must be on the workers' PATH. Every tool is idempotent, so a retried task reuses what a
failed attempt finished, and mega-train resumes from its newest checkpoint.
"""

from __future__ import annotations

import pendulum

try:  # Airflow 3
    from airflow.providers.standard.operators.bash import BashOperator
    from airflow.sdk import DAG, Param
except ImportError:  # Airflow 2
    from airflow import DAG
    from airflow.models.param import Param
    from airflow.operators.bash import BashOperator

# The artifact path a tool's --json summary names, printed last (what BashOperator pushes to XCom).
OUT = "| python3 -c 'import json, sys; print(json.load(sys.stdin)[\"out\"])'"
# mega-train's --json: the final checkpoint; a run stopped early (SIGTERM: it saved a checkpoint and
# exited 0) fails the task instead, and the task's retry resumes it.
DONE = (
    '| python3 -c \'import json, sys; s = json.load(sys.stdin); print(s["out"]) if s["complete"] else '
    'sys.exit("stopped at step %d of %d; a retry resumes" % (s["step"], s["train_steps"]))\''
)
P = "{{ params.%s }}"
XCOM = "{{ ti.xcom_pull(task_ids='%s') }}"

with DAG(
    dag_id="mega_chain",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    schedule=None,
    catchup=False,
    params={
        "corpus": Param("corpus.jsonl.zst", type="string"),
        "tokenizer": Param("tokenizer.model", type="string"),
        "hf_model": Param("hf-model", type="string"),
        "out": Param("chain-out", type="string"),
        "tp": Param(2, type="integer", minimum=1),
        "pp": Param(2, type="integer", minimum=1),
        "nproc": Param(4, type="integer", minimum=1),
        "steps": Param(1000, type="integer", minimum=1),
    },
    tags=["mega"],
) as dag:
    tokenize = BashOperator(
        task_id="tokenize",
        bash_command=f"mega-tokenize {P % 'corpus'} {P % 'out'}/tokens --tokenizer {P % 'tokenizer'} "
        f"--no-progress --json {OUT}",
    )
    convert = BashOperator(
        task_id="convert",
        bash_command=f"mega-convert hf {P % 'hf_model'} {P % 'out'}/ckpt --json {OUT}",
    )
    shard = BashOperator(
        task_id="shard",
        bash_command=f"mega-shard {XCOM % 'convert'} {P % 'out'}/ckpt-tp{P % 'tp'}pp{P % 'pp'} "
        f"--tp {P % 'tp'} --pp {P % 'pp'} --json {OUT}",
    )
    # The run manifest names the upstream artifacts; the task prints the final checkpoint's path.
    run_json = (
        'python3 -c \'import json, sys; json.dump({"kind": "run", "format_version": 5, '
        '"out": sys.argv[1], "model": {"init": sys.argv[2]}, "data": {"sources": '
        '[{"path": sys.argv[3]}], "split": [0.99, 0.01]}, "batch": {"micro_batch_size": 1, '
        '"global_batch_size": 8, "seq_length": 1024}, "train_steps": int(sys.argv[4]), '
        '"parallel": {"tp": int(sys.argv[5]), "pp": int(sys.argv[6])}}, open(sys.argv[7], "w"))\' '
    )
    train = BashOperator(
        task_id="train",
        bash_command=(
            f"set -eo pipefail; run={P % 'out'}/run.json; {run_json} $(realpath {P % 'out'})/run "
            f"$(realpath {XCOM % 'shard'}) $(realpath {XCOM % 'tokenize'}) {P % 'steps'} {P % 'tp'} "
            f"{P % 'pp'} $run; torchrun --nproc-per-node {P % 'nproc'} $(command -v mega-train) "
            f"--manifest $run --json {DONE}"
        ),
    )
    export = BashOperator(
        task_id="export",
        bash_command=f"mega-export {XCOM % 'train'} {P % 'out'}/hf --json {OUT}",
    )
    [tokenize, convert >> shard] >> train >> export
