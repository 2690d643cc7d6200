"""mega-train across nodes, as on a cluster: two torchrun agents ("nodes") of two processes each,
started concurrently on loopback, meeting at a c10d rendezvous; both see the same filesystem, as
nodes do on a cluster's shared one.

The SLURM recipe (examples/slurm/train.sbatch) runs for real against mega-train with only `srun` and
`scontrol` stubbed (tiny shell scripts on PATH standing in for SLURM): SIGUSR1 to the batch shell
(what `#SBATCH --signal=B:USR1@...` sends before the time limit) is forwarded through srun and
torchrun to every worker, which save at the next step boundary and exit 0; the script requeues the
job, and its rerun resumes from that checkpoint and finishes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import BIN, run_tool
from megacore.artifacts import open_artifact
from runlib import assert_losses_close, free_port, losses, metrics, ok, write_run

STEPS = 8


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tokens: Path) -> Path:
    """The reference: one process, micro batch 2 (accumulation 4), STEPS steps."""
    run_json = write_run(tmp_path_factory.mktemp("one"), tokens, train_steps=STEPS, eval={"every": 0})
    ok(run_tool("mega-train", "--manifest", run_json))
    return run_json.parent / "run"


def node(run_json: Path, nnodes: int, nproc: int, endpoint: str) -> subprocess.Popen:
    """One node's torchrun agent, as the SLURM recipe starts it on each node."""
    cmd = [
        str(BIN / "torchrun"), "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "test-job",
        str(BIN / "mega-train"), "--manifest", str(run_json),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow  # 25 s; make test keeps two nodes through the SLURM script (its save, requeue, resume)
def test_two_nodes_match_one_process(tmp_path: Path, tokens: Path, one_process: Path) -> None:
    """tp2 x dp2 over two nodes of two processes: torchrun gives each node a block of ranks, so tp
    stays within a node and data parallel (FSDP2's gathers and reductions) crosses between them, as
    on a cluster. The loss at every step within LOSS_REL of one process; one metrics.jsonl and one
    final checkpoint holding both nodes' pieces."""
    run_json = write_run(
        tmp_path,
        tokens,
        train_steps=STEPS,
        eval={"every": 0},
        parallel={"tp": 2},
        batch={"micro_batch_size": 2},
    )
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [node(run_json, 2, 2, endpoint) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in nodes]
    for p, (stdout, stderr) in zip(nodes, outs, strict=True):
        assert p.returncode == 0, (stdout[-2000:], stderr[-3000:])
    # Rank 0 alone prints the plan and the step lines: on one node, whichever the rendezvous made first.
    plan = "world 4 = tp 2 x pp 1 x dp 2; batch 8 = micro 2 x dp 2 x accum 2"
    assert sorted(o.count(plan) for o, _ in outs) == [0, 1], outs
    assert sorted(o.count(f"step {STEPS}/{STEPS}") for o, _ in outs) == [0, 1]
    out = tmp_path / "run"
    assert [r["world_size"] for r in metrics(out)] == [4] * STEPS
    assert_losses_close(losses(out), losses(one_process))
    final = open_artifact(out / "checkpoints" / "latest", "checkpoint", verify="sha256")
    layout = final.layout
    assert (layout.tp, layout.pp, layout.dp, final.training.step) == (2, 1, 2, STEPS)
    assert len(final.training.rng_files) == 4  # every rank of both nodes wrote its state


SBATCH = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "train.sbatch"

# Stand-ins for SLURM's commands (not ours to test): each records its arguments. srun runs its command
# once per node of the allocation, here all on this machine, and forwards SIGUSR1 to those tasks as
# srun does (Slurm's src/srun/signals.c `_forward_signal`); scontrol expands a comma-separated node
# list and does nothing else.
FAKE_SRUN = """#!/bin/bash
echo "$*" >> "$FAKE_SLURM_LOG/srun"
while [[ $1 == -* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "$@" & pids+=($!); done
trap 'echo USR1 >> "$FAKE_SLURM_LOG/srun"; kill -USR1 "${pids[@]}" 2>/dev/null' USR1
rc=0
for p in "${pids[@]}"; do
  while :; do wait "$p"; r=$?; kill -0 "$p" 2>/dev/null || break; done
  ((r)) && rc=$r
done
exit $rc
"""
FAKE_SCONTROL = """#!/bin/bash
echo "$*" >> "$FAKE_SLURM_LOG/scontrol"
if [[ $1 == show && $2 == hostnames ]]; then tr , '\\n' <<< "$3"; fi
"""


def test_sbatch_script_parses() -> None:
    proc = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_slurm_script_saves_requeues_and_resumes(tmp_path: Path, tokens: Path) -> None:
    """examples/slurm/train.sbatch for real (bash, torchrun, mega-train) on two "nodes" of one process
    each, with srun and scontrol stubbed: SIGUSR1 to the batch shell reaches every worker through
    srun and torchrun; they save at one step boundary and exit 0; the script requeues the job and
    exits 0. Run again (the requeued job), it resumes from that checkpoint and finishes, no requeue."""
    steps = 30
    run_json = write_run(
        tmp_path, tokens, train_steps=steps, eval={"every": 0}, checkpoint={"every": 1000},
        batch={"micro_batch_size": 4},
    )  # fmt: skip
    out, log, fake = tmp_path / "run", tmp_path / "slurm-log", tmp_path / "fake-bin"
    log.mkdir()
    fake.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    env = {
        **os.environ, "PATH": f"{fake}:{BIN}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
        "FAKE_SLURM_LOG": str(log), "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "localhost,localhost", "NPROC_PER_NODE": "1", "RDZV_PORT": str(free_port()),
    }  # fmt: skip

    def sbatch() -> subprocess.Popen:
        cmd = ["bash", str(SBATCH), str(run_json)]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    job = sbatch()
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "metrics.jsonl").is_file() and len(metrics(out)) >= 3):
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@...` does
    stdout, stderr = job.communicate(timeout=180)
    assert job.returncode == 0, (stdout[-3000:], stderr[-3000:])
    saved = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert len(saved) == 1, (saved, stdout[-3000:])
    step = int(saved[0].removeprefix("step-"))
    assert 3 <= step < steps
    assert "train.sbatch: SIGUSR1 (time limit near)" in stdout  # the batch shell's trap ran
    assert f"SIGUSR1 at step {step}: checkpoint saved" in stdout
    # Each node's torchrun caught it and passed it on (the fake srun signals torchrun alone).
    assert stderr.count("Received 10 death signal, shutting down workers") == 2, stderr[-3000:]
    assert metrics(out)[-1]["step"] == step
    scontrol = (log / "scontrol").read_text().splitlines()
    assert scontrol == ["show hostnames localhost,localhost", "requeue 4242"]
    srun = (log / "srun").read_text().splitlines()
    assert srun[0].startswith("--ntasks-per-node=1 --kill-on-bad-exit=1 torchrun --nnodes 2 ")
    assert "--rdzv-endpoint localhost:" in srun[0] and "--rdzv-id 4242" in srun[0]
    assert srun[1:] == ["USR1"]

    rerun = sbatch()
    stdout, stderr = rerun.communicate(timeout=180)
    assert rerun.returncode == 0, (stdout[-3000:], stderr[-3000:])
    assert f"resuming from {out / 'checkpoints' / saved[0]} (step {step} of {steps})" in stdout
    assert [r["step"] for r in metrics(out)] == list(range(1, steps + 1))
    assert (log / "scontrol").read_text().splitlines() == [*scontrol, "show hostnames localhost,localhost"]
    assert os.readlink(out / "checkpoints" / "latest") == f"step-{steps:08d}"
