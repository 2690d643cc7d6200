"""LoRA runs of mega-train: adapters trained on a frozen base checkpoint (the reference run's), their
checkpoints (adapters, moments, the base named), a run killed and resumed in another layout equal
to one uninterrupted process, and bad `lora` sections refused in one line before anything starts."""

from __future__ import annotations

import hashlib
import json
import signal
from pathlib import Path

import pytest

from helpers import assert_one_line_error
from runlib import assert_losses_close, checkpoint_tensors, losses, ok, torchrun, train, write_run

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"rank": 4, "alpha": 8, "targets": PROJECTIONS}
STEPS = {"train_steps": 6, "checkpoint": {"every": 3}, "eval": {"every": 0}}


@pytest.fixture(scope="module")
def base(reference: Path) -> Path:
    return reference / "checkpoints" / "step-00000012"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tokens: Path, base: Path) -> Path:
    """6 LoRA steps in one process, checkpoints at 3 and 6."""
    run_json = write_run(tmp_path_factory.mktemp("lora-one"), tokens, init=base, lora=LORA, **STEPS)
    ok(train(run_json))
    return run_json.parent / "run"


def test_lora_checkpoints_hold_the_adapters_and_name_their_base(one_process: Path, base: Path) -> None:
    """A LoRA run's checkpoint: the 4 layers x 7 projections' A and B and their two AdamW moments,
    none of the base's tensors, and the base by path and manifest sha256; the base is unchanged
    (frozen) and the adapters moved from PEFT's start (B zero)."""
    ckpt = one_process / "checkpoints" / "step-00000006"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert len(manifest["tensors"]) == 4 * 7 * 2 * 3
    assert not any(name.startswith(("embed", "norm", "lm_head")) for name in manifest["tensors"])
    adapter = manifest["adapter"]
    assert (adapter["rank"], adapter["alpha"], adapter["targets"]) == (4, 8.0, PROJECTIONS)
    assert (
        adapter["base"]["manifest_sha256"]
        == hashlib.sha256((base / "manifest.json").read_bytes()).hexdigest()
    )
    assert Path(adapter["base"]["path"]) == base == (ckpt / adapter["base"]["relative"]).resolve()
    tensors = checkpoint_tensors(ckpt)
    assert tensors["layers.0.attn.q_proj.lora_B.weight"].abs().max() > 0
    assert tensors["layers.0.attn.q_proj.lora_A.weight"].shape == (4, 32)
    assert tensors["layers.3.mlp.down_proj.lora_B.weight"].shape == (32, 4)


@pytest.mark.slow  # make test: the launcher's line in test_lifecycle, a resume in test_resume_matrix
def test_lora_killed_and_resumed_in_another_layout_matches_one_process(
    tmp_path: Path, tokens: Path, base: Path, one_process: Path
) -> None:
    """Rank 0 killed (SIGKILL) in step 5 at tp 2 with sequence parallel (the launcher names it, not
    rank 1 whose collective then failed), resumed from step 3's checkpoint at pp 2: the losses are
    the uninterrupted process's (fp32, 1e-5) and so are the final adapters, within 1e-4 norm-wise
    after six AdamW steps (the equivalence tests' ADAM_REL: AdamW divides each element by its own
    running RMS; measured up to 1.6e-5 here)."""
    run_json = write_run(
        tmp_path, tokens, init=base, lora=LORA, **STEPS, parallel={"tp": 2, "sequence_parallel": True}
    )
    killed = train(run_json, "--nproc-per-node", "2", env={"MEGA_TRAIN_INJECT": "kill@5/r0"})
    assert killed.returncode == 128 + signal.SIGKILL, killed.stderr[-3000:]
    assert "mega-train: error: rank 0 was killed by SIGKILL" in killed.stderr, killed.stderr[-3000:]
    write_run(tmp_path, tokens, init=base, lora=LORA, **STEPS, parallel={"pp": 2})
    ok(torchrun(2, run_json))
    assert_losses_close(losses(tmp_path / "run"), losses(one_process), rel=1e-5)
    want = checkpoint_tensors(one_process / "checkpoints" / "step-00000006")
    got = checkpoint_tensors(tmp_path / "run" / "checkpoints" / "step-00000006")
    assert set(got) == set(want)
    for name, t in want.items():
        assert float((got[name] - t).norm() / t.norm()) < 1e-4, name


@pytest.mark.parametrize(
    ("lora", "fragments"),
    [
        ({"rank": 0, "targets": ["q_proj"]}, ("$.lora.rank", ">= 1")),
        ({"rank": 64, "targets": ["q_proj"]}, ("$.lora.rank", "rank 64 is above q_proj's size")),
        ({"targets": ["q_proj", "qkv"]}, ("$.lora.targets", "'qkv' is no module", "q_proj, k_proj")),
        ({"rank": 4}, ("$.lora.targets", "give the modules to adapt")),
        ({"targets": ["q_proj", "v_proj", "q_proj"]}, ("$.lora.targets", "'q_proj' is given twice")),
    ],
    ids=["rank-0", "rank-above-size", "unknown-target", "no-targets", "twice"],
)
def test_bad_lora_sections_are_one_line(
    tmp_path: Path, tokens: Path, base: Path, lora: dict, fragments
) -> None:
    run_json = write_run(tmp_path, tokens, init=base, lora=lora)
    assert_one_line_error(train(run_json, "--dry-run"), *fragments)
    assert not (tmp_path / "run").exists()


def test_lora_needs_a_base_and_its_own_adapter(
    tmp_path: Path, tokens: Path, base: Path, one_process: Path
) -> None:
    """LoRA from fresh weights, an adapter given as the base, an adapter of another base as
    `lora.init` and a `lora.init` that is not there: each one line."""
    fresh = write_run(tmp_path / "fresh", tokens, lora=LORA)
    assert_one_line_error(train(fresh, "--dry-run"), "$.lora", "give it as $.model.init")
    adapter = one_process / "checkpoints" / "step-00000003"
    swapped = write_run(tmp_path / "swapped", tokens, init=adapter, lora=LORA)
    assert_one_line_error(train(swapped, "--dry-run"), "$.model.init", "is a LoRA adapter")
    other = base.parent / "step-00000008"  # the same model 4 steps earlier: another base
    foreign = write_run(tmp_path / "foreign", tokens, init=other, lora={"init": str(adapter)})
    assert_one_line_error(train(foreign, "--dry-run"), "$.lora.init", "an adapter of another base")
    missing = write_run(tmp_path / "missing", tokens, init=base, lora={"init": str(tmp_path / "nowhere")})
    assert_one_line_error(train(missing, "--dry-run"), "$.lora.init", "nowhere: no such artifact directory")


def test_a_lora_runs_memory_plan_counts_the_adapters_state_alone(
    tmp_path: Path, tokens: Path, base: Path
) -> None:
    """The dry run plans a LoRA run (one process, fp32) as it holds it: the frozen base's weights,
    and gradients and AdamW moments for the adapters alone, worked out here from the tiny Llama's
    shapes (hidden 32, ffn 64, 2 kv heads of 8, 4 layers, rank 4)."""
    run_json = write_run(tmp_path, tokens, init=base, lora=LORA)
    rank = json.loads(ok(train(run_json, "--dry-run", "--gpu-memory", "80GB", "--json")).stdout)["memory"][
        "ranks"
    ]
    h, f, kv, r = 32, 64, 16, 4
    # (in, out) of q, k, v, o, gate, up, down: A is r x in, B out x r
    adapters = 4 * sum(r * (i + o) for i, o in [(h, h), (h, kv), (h, kv), (h, h), (h, f), (h, f), (f, h)])
    assert len(rank) == 1 and rank[0]["grads"] == 4 * adapters, rank
    assert rank[0]["optimizer"] == 8 * adapters + 4 * (4 * 7 * 2)  # the moments and a step per tensor
