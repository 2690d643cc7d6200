"""The Kubernetes example (examples/kubernetes/pytorchjob.yaml, a Kubeflow PyTorchJob).

Its structure: one pod template for the Master and the Workers, restarts in the job (OnFailure, a
backoff limit, torchrun's --max-restarts), a grace period that covers torchrun's wait for a save, the
shared volume, /dev/shm, one GPU per process. Then its container's script runs for real here (bash,
torchrun on gloo, mega-train), in the environment the training operator gives each pod
(MASTER_ADDR, MASTER_PORT, PET_NNODES, PET_NPROC_PER_NODE, RANK, ...), the Master's service being
localhost: one pod of two processes trains to the end and exits 0; two pods of one process each,
SIGTERM to the Master pod's PID 1 (what the kubelet sends a pod being deleted) saves one checkpoint
in both, the other pod exits non-zero (so that OnFailure restarts it), and the pods started again
resume from that checkpoint, finish and exit 0 (make test-slow). Not tested: a real cluster (the operator, the
kubelet, DNS, the volume), GPUs, NCCL.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from helpers import BIN
from runlib import free_port, metrics, write_run

JOB = Path(__file__).resolve().parents[2] / "examples" / "kubernetes" / "pytorchjob.yaml"

# A stop must finish the step, wait for an asynchronous save in flight and write one checkpoint before
# torchrun's --shutdown-timeout. A checkpoint is 12 bytes a parameter (fp32 weights and two AdamW
# moments; bench/README.md: 5.95 GB for 0.5B parameters, 13.7 s on one local disk), so a 70B model on
# 2 nodes writes 420 GB a node: minutes on a shared file system at 1-2 GB/s.
MIN_SHUTDOWN_S = 300
# The kubelet's SIGKILL must come after torchrun's own deadline, with time for it and bash to exit.
MIN_EXIT_MARGIN_S = 30


def load_job() -> dict:
    return yaml.safe_load(JOB.read_text())


def pod_spec(job: dict) -> dict:
    return job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]


def script(job: dict) -> str:
    (container,) = pod_spec(job)["containers"]
    assert container["command"] == ["bash", "-c"]
    (text,) = container["args"]
    return text


def test_the_job_restarts_in_place_with_one_pod_template() -> None:
    job = load_job()
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    assert replicas["Worker"]["template"] is replicas["Master"]["template"]  # one YAML anchor
    # ExitCode would fail the job on torchrun's exit 1; OnFailure restarts, up to backoffLimit.
    assert {r["restartPolicy"] for r in replicas.values()} == {"OnFailure"}
    assert job["spec"]["runPolicy"]["backoffLimit"] > len(replicas)
    assert "elasticPolicy" not in job["spec"]
    (container,) = pod_spec(job)["containers"]
    assert container["name"] == "pytorch"  # the operator's: it reads its port and exit code
    assert {"name": "pytorchjob-port", "containerPort": 23456} in container["ports"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == int(job["spec"]["nprocPerNode"])
    text = script(job)
    for option in (
        '--nnodes "$PET_NNODES"', '--nproc-per-node "$PET_NPROC_PER_NODE"', "--rdzv-backend c10d",
        '--rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"', "--max-restarts 3",
        '"$(command -v mega-train)" --manifest "$MANIFEST"',
    ):  # fmt: skip
        assert option in text, option
    assert "trap " in text  # bash is PID 1: it forwards SIGTERM itself


def test_the_grace_period_covers_a_save_and_the_volumes_are_shared() -> None:
    job = load_job()
    spec = pod_spec(job)
    shutdown = int(re.search(r"--shutdown-timeout (\d+)", script(job)).group(1))
    assert shutdown >= MIN_SHUTDOWN_S
    assert spec["terminationGracePeriodSeconds"] >= shutdown + MIN_EXIT_MARGIN_S
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    (shared,) = [path for path, name in mounts.items() if "persistentVolumeClaim" in volumes[name]]
    manifest = {e["name"]: e["value"] for e in spec["containers"][0]["env"]}["MANIFEST"]
    assert manifest.startswith(shared + "/")


def start_pod(job: dict, run_json: Path, port: int, nnodes: int, nproc: int, rank: int) -> subprocess.Popen:
    """The container's script as the pod of node `rank` runs it: the container's env from the YAML,
    the manifest's path on the volume replaced, and what the training operator adds (v1.9's
    envvar.go), the Master's service name being localhost here."""
    container = pod_spec(job)["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]} | {"MANIFEST": str(run_json)}
    env |= {
        "MASTER_ADDR": "localhost", "MASTER_PORT": str(port), "PET_MASTER_ADDR": "localhost",
        "PET_MASTER_PORT": str(port), "WORLD_SIZE": str(nnodes * nproc), "RANK": str(rank),
        "PET_NODE_RANK": str(rank), "PET_NNODES": str(nnodes), "PET_NPROC_PER_NODE": str(nproc),
        "PYTHONUNBUFFERED": "1",
    }  # fmt: skip
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1", **env}
    cmd = ["bash", "-c", script(job)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(pods: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """Each pod's exit code and its output (stdout and stderr)."""
    outs = [p.communicate(timeout=300) for p in pods]
    return [(p.returncode, stdout + stderr) for p, (stdout, stderr) in zip(pods, outs, strict=True)]


def test_one_pod_trains_to_the_end(tmp_path: Path, tokens: Path) -> None:
    steps = 6
    run_json = write_run(tmp_path, tokens, train_steps=steps, eval={"every": 0})
    [(code, output)] = finish([start_pod(load_job(), run_json, free_port(), nnodes=1, nproc=2, rank=0)])
    assert code == 0, output[-4000:]
    out = tmp_path / "run"
    assert [r["world_size"] for r in metrics(out)] == [2] * steps
    assert os.readlink(out / "checkpoints" / "latest") == f"step-{steps:08d}"
    assert "not complete" not in output


def wait_listening(port: int, pod: subprocess.Popen) -> None:
    """Until the Master pod's torchrun hosts the rendezvous store, as the Master does on a cluster
    (here every pod's host is localhost: the first to bind the port hosts it)."""
    deadline = time.monotonic() + 60
    while True:
        assert pod.poll() is None and time.monotonic() < deadline, "the Master pod did not start"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)


def start_two_pods(job: dict, run_json: Path) -> list[subprocess.Popen]:
    port = free_port()
    master = start_pod(job, run_json, port, nnodes=2, nproc=1, rank=0)
    wait_listening(port, master)
    return [master, start_pod(job, run_json, port, nnodes=2, nproc=1, rank=1)]


@pytest.mark.slow  # 21 s: make test keeps the one-pod run of the same script
def test_sigterm_to_one_pod_restarts_the_other_and_the_run_resumes(tmp_path: Path, tokens: Path) -> None:
    steps = 24
    run_json = write_run(
        tmp_path, tokens, train_steps=steps, eval={"every": 0}, checkpoint={"every": 1000},
        batch={"micro_batch_size": 4},
    )  # fmt: skip
    out, job = tmp_path / "run", load_job()
    pods = start_two_pods(job, run_json)
    deadline = time.monotonic() + 120
    while not ((out / "metrics.jsonl").is_file() and len(metrics(out)) >= 2):
        assert time.monotonic() < deadline and pods[1].poll() is None, finish(pods)
        time.sleep(0.05)
    pods[0].send_signal(signal.SIGTERM)  # the kubelet deleting the Master pod
    (_, master_out), (code, worker_out) = finish(pods)
    saved = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert len(saved) == 1, (saved, master_out[-3000:], worker_out[-3000:])
    step = int(saved[0].removeprefix("step-"))
    assert 2 <= step < steps
    assert f"SIGTERM at step {step}: checkpoint saved" in master_out + worker_out
    # The other pod's workers stopped at that step too and exited 0: its script exits 1 so that
    # OnFailure restarts it, rather than the job ending as complete.
    assert code == 1, worker_out[-3000:]
    assert "pytorchjob: the run is not complete (torchrun exited 0)" in worker_out

    restarted = finish(start_two_pods(job, run_json))  # the Master recreated, the Worker restarted
    assert [c for c, _ in restarted] == [0, 0], [o[-3000:] for _, o in restarted]
    resumed = f"resuming from {out / 'checkpoints' / saved[0]} (step {step} of {steps})"
    assert resumed in restarted[0][1] + restarted[1][1]
    assert [r["step"] for r in metrics(out)] == list(range(1, steps + 1))
    assert os.readlink(out / "checkpoints" / "latest") == f"step-{steps:08d}"
