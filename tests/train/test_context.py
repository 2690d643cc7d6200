"""Context extension from any checkpoint (#23): a run from `model.init` sets `max_seq_len` and
`rope_scaling` (linear, dynamic, llama3, yarn) beside it; the plan's config is the init's with that
context, the run's checkpoints record it, mega-export writes it so that transformers gives our logits
at every position, and a resume that changes it, or a manifest setting another model field beside
`init`, is refused naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from helpers import assert_one_line_error
from hf_cases import load_hf, randomize
from mega_convert.convert import convert_hf
from mega_convert.verify import verify
from mega_export.export import export_hf
from mega_train.run_plan import plan_run
from megacore.artifacts import MANIFEST_NAME, open_artifact
from megacore.artifacts.codec import decode_manifest, encode_manifest
from megacore.checkpoint import CheckpointReader
from megacore.errors import UserError
from runlib import losses, ok, train, write_run

TRAINED, LONG = 256, 1024  # the init's context and the run's
SCALINGS = {
    "linear": {"type": "linear", "factor": 4.0},
    "dynamic": {"type": "dynamic", "factor": 4.0},
    "llama3": {"type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "yarn": {"type": "yarn", "factor": 4.0, "beta_fast": 16.0},
}
TOL = 1e-4


@pytest.fixture(scope="module")
def init(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random transformers Llama of 256 positions (the tokens' vocab of 400), converted."""
    root = tmp_path_factory.mktemp("context-init")
    config = LlamaConfig(
        vocab_size=400, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=TRAINED,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    randomize(model)
    model.save_pretrained(root / "hf")
    convert_hf(root / "hf", root / "ckpt", log=lambda msg: None)
    return root / "ckpt"


def context_run(directory: Path, tokens: Path, model: dict, **overrides) -> Path:
    """A run.json of `init` + `model`'s fields at seq_length 1024: 2 steps of batch 1, one checkpoint."""
    run_json = write_run(
        directory, tokens, batch={"micro_batch_size": 1, "global_batch_size": 1, "seq_length": LONG},
        train_steps=2, checkpoint={"every": 2}, eval={"every": 0}, data={"split": [1, 0]},
        optimizer={"lr": 1e-3, "warmup_steps": 0, "min_lr": 0.0}, **overrides,
    )  # fmt: skip
    run = json.loads(run_json.read_text())
    run["model"] = model  # in place of write_run's `config`
    run_json.write_text(json.dumps(run, indent=1))
    return run_json


def extended(init: Path, model: dict, tmp_path: Path, tokens: Path) -> Path:
    """The init as the run would train it, without training: its weights under the plan's config."""
    plan = plan_run(context_run(tmp_path, tokens, {"init": str(init), **model}), world_size=1)
    out = tmp_path / "extended"
    shutil.copytree(init, out)
    manifest = decode_manifest((init / MANIFEST_NAME).read_bytes(), str(init), kind="checkpoint")
    (out / MANIFEST_NAME).write_bytes(encode_manifest(msgspec.structs.replace(manifest, config=plan.config)))
    return out


def assert_transformers_logits_equal_ours(checkpoint: Path, hf_dir: Path) -> None:
    """fp32 logits of a 1,024-token sequence, at every position."""
    ids = torch.randint(0, 400, (1, LONG), generator=torch.Generator().manual_seed(0))
    with CheckpointReader(checkpoint) as ckpt:
        ours = ckpt.decoder(torch.float32).eval()
    with torch.no_grad():
        got = ours(ids)[..., :400]
        ref = load_hf(hf_dir)(ids).logits
    err = (got - ref).abs().amax(-1)[0]  # per position
    assert ref.abs().max() > 0.5 and err.max().item() < TOL, (err.max().item(), int(err.argmax()))


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_extended_context_exports_what_transformers_reproduces(
    kind: str, init: Path, tmp_path: Path, tokens: Path
) -> None:
    """256 -> 1,024 positions with each scaling type through the run's own plan: its config is the
    init's with that context (the original context defaulting to the init's 256), and exported it
    gives transformers our logits at all 1,024 positions, the scaling in config.json."""
    model = {"max_seq_len": LONG, "rope_scaling": SCALINGS[kind]}
    ckpt = extended(init, model, tmp_path, tokens)
    config = open_artifact(ckpt, "checkpoint").config
    before = open_artifact(init, "checkpoint").config
    assert config.max_seq_len == LONG and config.rope.scaling.type == kind
    unscaled = msgspec.structs.replace(config.rope, scaling=None)
    assert msgspec.structs.replace(config, max_seq_len=TRAINED, rope=unscaled) == before
    if kind != "linear":
        assert config.rope.scaling.original_max_position_embeddings == TRAINED
    export_hf(ckpt, tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["rope_scaling"]["rope_type"] == kind and hf["rope_scaling"]["factor"] == 4.0
    # transformers' dynamic NTK measures growth against max_position_embeddings: the original context.
    assert hf["max_position_embeddings"] == (TRAINED if kind == "dynamic" else LONG)
    assert_transformers_logits_equal_ours(ckpt, tmp_path / "hf")
    # mega-convert verify takes the export as the same model (dynamic's context as config.json has it).
    assert verify(ckpt, tmp_path / "hf", seq_len=LONG, batch=1)["passed"]


def test_a_run_trains_the_longer_context_and_its_export_matches_transformers(
    init: Path, tmp_path: Path, tokens: Path
) -> None:
    """2 steps at 1,024 tokens from the 256-position init with linear x4, each sequence over cp 2 x
    tp 2 with sequence parallel (4 processes): the plan says so, the losses are one process's, the
    checkpoint records the new config, its export reproduces it in transformers; resuming with
    another context is refused, naming the field."""
    model = {"init": str(init), "max_seq_len": LONG, "rope_scaling": SCALINGS["linear"]}
    one = context_run(tmp_path / "one", tokens, model)
    run_json = context_run(tmp_path, tokens, model, parallel={"tp": 2, "cp": 2, "sequence_parallel": True})
    proc = ok(train(run_json, "--nproc-per-node", "4"))
    assert f"context: 1,024 positions (the init's {TRAINED})" in proc.stdout + proc.stderr
    assert "world 4 = tp 2 x pp 1 x cp 2 x dp 1" in proc.stdout, proc.stdout
    ok(train(one))
    want, got = losses(tmp_path / "one" / "run"), losses(tmp_path / "run")
    assert len(got) == 2 and all(abs(a - b) < 1e-5 * abs(b) for a, b in zip(got, want, strict=True)), (
        got,
        want,
    )
    last = tmp_path / "run" / "checkpoints" / "latest"
    config = open_artifact(last, "checkpoint").config
    assert (config.max_seq_len, config.rope.scaling.type, config.rope.scaling.factor) == (LONG, "linear", 4.0)
    export_hf(last, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["rope_scaling"]["factor"] == 4.0
    assert_transformers_logits_equal_ours(last, tmp_path / "hf")

    for field, value in (("max_seq_len", 2048), ("rope_scaling", {"type": "linear", "factor": 8.0})):
        context_run(tmp_path, tokens, {**model, field: value})
        assert_one_line_error(train(run_json, "--dry-run"), f"$.model.{field} differs from the checkpoint")
        assert_one_line_error(train(run_json), f"$.model.{field} differs from the checkpoint")


def test_only_the_context_can_be_set_beside_init(init: Path, tmp_path: Path, tokens: Path) -> None:
    """Beside `init`, a model field other than max_seq_len and rope_scaling is one line naming it; so
    is the context beside `config`, a scaling missing what it needs, a longer sequence than the
    model's context without a new one, and a mixture's router settings for a dense model."""
    run_json = context_run(tmp_path, tokens, {"init": str(init), "max_seq_len": LONG, "rope": {"theta": 1e6}})
    assert_one_line_error(train(run_json, "--dry-run"), "$.model.rope: a run from `init` keeps")
    config = open_artifact(init, "checkpoint").config
    cases = [
        ({"init": str(init), "config": config}, "$.model.config: give exactly one of"),
        ({"config": config, "max_seq_len": LONG}, "$.model.max_seq_len: a run from `config` or `hf_config` sets it"),
        ({"init": str(init), "max_seq_len": LONG, "rope_scaling": {"type": "llama3", "factor": 4.0}},
         "$.model.rope_scaling: llama3 rope scaling needs low_freq_factor"),
        ({"init": str(init), "max_seq_len": LONG, "rope_scaling": {"type": "linear", "factor": 4, "beta_fast": 8}},
         "$.model.rope_scaling: linear rope scaling has no beta_fast"),
        ({"init": str(init)}, "$.batch.seq_length: 1024 exceeds the model's max_seq_len 256"),
        # A mixture's training settings are the run's, whatever the start; a dense model has none.
        ({"init": str(init), "max_seq_len": LONG, "router_aux_loss_coef": 0.01},
         "$.model.router_aux_loss_coef: the model is not a mixture of experts"),
        ({"config": msgspec.structs.replace(config, max_seq_len=LONG), "router_bias_update": 0.01},
         "$.model.router_bias_update: the model is not a mixture"),
    ]  # fmt: skip
    for model, fragment in cases:
        run = json.loads(run_json.read_text())
        run["model"] = msgspec.to_builtins(model)
        run_json.write_text(json.dumps(run))
        with pytest.raises(UserError) as e:
            plan_run(run_json, world_size=1)
        assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_planner_sizes_the_extended_model(init: Path, tmp_path: Path, tokens: Path) -> None:
    """The dry run plans the model the run trains: the init's at 1,024 positions, as the note says."""
    run_json = context_run(
        tmp_path, tokens, {"init": str(init), "max_seq_len": LONG, "rope_scaling": SCALINGS["yarn"]}
    )
    argv = ("--dry-run", "--gpus", "1", "--gpu-memory", "80GB")
    plan = json.loads(ok(train(run_json, *argv, "--json")).stdout)
    assert plan["model"]["max_seq_len"] == LONG and plan["batch"]["seq_length"] == LONG
    assert plan["memory"]["fits"] is True
    text = ok(train(run_json, *argv)).stdout
    assert "RoPE yarn x4 of 256; the run's checkpoints record this config" in text, text
    assert "micro batch 1 x 1024 tokens" in text, text
