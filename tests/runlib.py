"""Helpers for mega-train tests (tests/ is on the path): a tiny Llama config, run manifests, running
mega-train (one process or under torchrun), metrics and losses."""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

from helpers import BIN, run_in_process, run_tool

# Tiny Llama, vocab 400 (the tokenizer's) padded to 512: GQA, the padding rows stay zero.
TINY_LLAMA = {
    "family": "llama",
    "vocab_size": 400,
    "hidden_size": 32,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "ffn_hidden_size": 64,
    "max_seq_len": 64,
}


def write_run(directory: Path, tokens: Path, init: Path | None = None, **overrides) -> Path:
    """A run.json in `directory`: the tiny Llama from config (or the checkpoint `init`) on `tokens`,
    fp32, 12 steps, batch 8 x 32 tokens, checkpoints every 4 steps, evaluation every 6; `overrides`
    replace top-level sections (dicts are merged one level deep)."""
    run = {
        "kind": "run",
        "format_version": 1,
        "out": "run",
        "model": {"config": dict(TINY_LLAMA)} if init is None else {"init": str(init)},
        "data": {"sources": [{"path": str(tokens)}], "split": [0.9, 0.1]},
        "batch": {"micro_batch_size": 2, "global_batch_size": 8, "seq_length": 32},
        "train_steps": 12,
        "precision": "fp32",
        "attention": "sdpa",
        "optimizer": {"lr": 3e-3, "warmup_steps": 2, "min_lr": 3e-4},
        "checkpoint": {"every": 4},
        "eval": {"every": 6, "iters": 2},
        "logging": {"every": 1},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(run.get(key), dict):
            run[key] = {**run[key], **value}
        else:
            run[key] = value
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "run.json"
    path.write_text(json.dumps(run, indent=1))
    return path


def checkpoint_tensors(path: Path) -> dict:
    """Every tensor of a checkpoint (weights and moments) by name."""
    from megacore.checkpoint import CheckpointReader

    with CheckpointReader(path) as ckpt:
        return {name: ckpt.read(name).clone() for name in ckpt.manifest.tensors}


def worker_rank(pid: int) -> int:
    """The rank torchrun gave worker `pid` (its RANK)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(e for e in environ if e.startswith(b"RANK=")).split(b"=")[1])


def metrics(out: Path, kind: str = "train") -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


# Parallel layouts against one process (fp32; reductions run in another order).
LOSS_REL = 1e-4


def torchrun(nproc: int, run_json: Path, *args: str, timeout: int = 600, **kw) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "torchrun"), "--nproc-per-node", str(nproc), "--master-port", str(free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **kw.pop("env", {})}
    cmd += [str(BIN / "mega-train"), "--manifest", str(run_json), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, **kw)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(run_json: Path, *args: str, fresh: bool = False, **kw) -> subprocess.CompletedProcess:
    """`mega-train --manifest run_json *args`: in this process through its CLI (a process group of
    one, made and destroyed by the run: the same code, without a second of interpreter and torch
    start-up a run), or as its own process where the test needs one: an environment of its own
    (`env`: injected faults, W&B, ...), its own launcher (`--nproc-per-node`), or a `fresh` one (a
    first compile, a peak memory of its own)."""
    if fresh or kw or "--nproc-per-node" in args:
        return run_tool("mega-train", "--manifest", run_json, *args, **kw)
    return run_in_process("mega-train", "--manifest", run_json, *args)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in metrics(out)]


def assert_losses_close(got: list[float], want: list[float], rel: float = LOSS_REL) -> None:
    assert len(got) == len(want), (got, want)
    for step, (a, b) in enumerate(zip(got, want, strict=True), 1):
        assert abs(a - b) <= rel * abs(b), (step, a, b)


def wandb_records(path: Path) -> list:
    """The records of a `.wandb` file (W&B's LevelDB-style log: a 7-byte file header, then 32 KiB
    blocks of chunks with a 7-byte header each: crc32c, length, type full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    block, pos, buf, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            records.append(record)
    return records


def wandb_history(path: Path) -> tuple[str, dict[int, dict]]:
    """The run id and the logged rows by step of an offline run's `.wandb` file."""
    run_id, rows = "", {}
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run_id = r.run.run_id
            config = {item.key: json.loads(item.value_json) for item in r.run.config.update}
            assert config["manifest"]["kind"] == "run" and config["parallel"]["dp"] == 1, config
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            rows.setdefault(r.history.step.num, {}).update(items)
    return run_id, rows


def greedy_completion(export: Path, prompt: str, new: int) -> str:
    """transformers' greedy completion (`new` tokens) of `prompt` by the export, as its users would
    ask for it: what a run's samples (`eval.samples`) must equal."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=new, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
