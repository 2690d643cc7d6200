"""mega-shard: any layout to any layout, bit-exact round trips, optimizer state, refusals."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from helpers import assert_bitwise_equal, assert_one_line_error, run_in_process, run_tool, write_checkpoint
from megacore.artifacts import TensorReader, open_artifact
from megacore.artifacts.manifest import TrainingState
from megacore.config import ModelConfig
from megacore.config_parts import LayerNormSpec, MoESpec, ParallelBlockSpec, StandardAttentionSpec
from megacore.parallel import optim_state_name
from megacore.parts import model_tensors

# Heads, ffn and vocab divide by 8; 2 kv heads so tp 8 replicates k/v and tp 2 splits them.
CFG = ModelConfig(
    family="llama", vocab_size=60, padded_vocab_size=64, hidden_size=32, num_layers=5, num_heads=8,
    num_kv_heads=2, ffn_hidden_size=64,
)  # fmt: skip
# 4 experts of ffn 16, so tp 2 splits each expert's ffn and ep 2 or 4 the experts.
MIXTRAL = ModelConfig(
    family="mixtral", vocab_size=64, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
    ffn_hidden_size=16, mlp=MoESpec(num_experts=4, experts_per_token=2),
)  # fmt: skip
FALCON = ModelConfig(
    family="falcon", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=1,
    ffn_hidden_size=128, norm=LayerNormSpec(bias=True), activation="gelu", block=ParallelBlockSpec(),
    attention=StandardAttentionSpec(bias=True, out_bias=True), mlp_bias=True, tie_embeddings=True,
)  # fmt: skip


@pytest.fixture
def shard():
    """mega-shard's command line run in this process (the subprocess start costs seconds per call)."""
    return functools.partial(run_in_process, "mega-shard")


def write_random(
    out: Path, cfg: ModelConfig, *, optim: bool = True, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A tp1/pp1 checkpoint of random bf16 weights (and fp32 AdamW moments), plus a tokenizer file."""
    g = torch.Generator().manual_seed(seed)
    shapes = model_tensors(cfg)
    tensors = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}
    if optim:
        for n, s in shapes.items():
            for kind in ("exp_avg", "exp_avg_sq"):
                tensors[optim_state_name(kind, n)] = torch.randn(s, generator=g)
    write_checkpoint(
        out,
        tensors,
        config=cfg,
        side_files={"tokenizer/tokenizer.json": b'{"fake": true}'},
        tokenizer_files=["tokenizer/tokenizer.json"],
        training=TrainingState(step=7, consumed_samples=56, scheduler={"lr": 1e-4}, optimizer="adamw"),
    )
    return tensors


def read_all(path: Path) -> dict[str, torch.Tensor]:
    m = open_artifact(path, "checkpoint")
    with TensorReader(path) as r:
        return {n: r.read(n, e) for n, e in m.tensors.items()}


def assert_bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for n in a:
        assert_bitwise_equal(a[n], b[n], n)


def test_round_trip_1x1_8x4_2x2_1x1_bit_exact(tmp_path: Path, shard) -> None:
    orig = write_random(tmp_path / "a", CFG)
    run_tool(
        "mega-shard",
        tmp_path / "a",
        tmp_path / "b",
        "--tp",
        "8",
        "--pp",
        "4",
        "--pp-layers",
        "1,2,1,1",
        check=True,
    )
    b = open_artifact(tmp_path / "b", "checkpoint")
    assert (b.layout.tp, b.layout.pp, b.layout.stage_layers) == (8, 4, [[0], [1, 2], [3], [4]])
    assert sorted(f.path for f in b.files if f.path.endswith(".safetensors")) == sorted(
        f"model-pp{s:02d}-tp{t:02d}.safetensors" for s in range(4) for t in range(8)
    )
    # The plan: q split on dim 0 by 8, o on dim 1, k replicated (2 kv heads < tp 8) and stored once.
    q = b.tensors["layers.2.attn.q_proj.weight"].pieces
    assert [(p.file, p.offset) for p in q] == [
        (f"model-pp01-tp{t:02d}.safetensors", [4 * t, 0]) for t in range(8)
    ]
    assert [p.offset for p in b.tensors["layers.0.attn.o_proj.weight"].pieces] == [
        [0, 4 * t] for t in range(8)
    ]
    assert [p.file for p in b.tensors["layers.4.attn.k_proj.weight"].pieces] == [
        "model-pp03-tp00.safetensors"
    ]
    assert [p.offset for p in b.tensors["optim.exp_avg.lm_head.weight"].pieces] == [
        [8 * t, 0] for t in range(8)
    ]
    assert b.tensors["embed.weight"].pieces[0].file == "model-pp00-tp00.safetensors"
    assert b.tensors["norm.weight"].pieces[0].file == "model-pp03-tp00.safetensors"
    assert b.training is not None and b.training.step == 7 and b.training.consumed_samples == 56
    assert (tmp_path / "b" / "tokenizer" / "tokenizer.json").read_text() == '{"fake": true}'
    assert_bit_exact(orig, read_all(tmp_path / "b"))

    shard(tmp_path / "b", tmp_path / "c", "--tp", "2", "--pp", "2", check=True)
    c = open_artifact(tmp_path / "c", "checkpoint")
    assert (c.layout.tp, c.layout.stage_layers) == (2, [[0, 1, 2], [3, 4]])
    assert len(c.tensors["layers.3.attn.k_proj.weight"].pieces) == 2  # 2 kv heads split over tp 2
    shard(tmp_path / "c", tmp_path / "d", check=True)
    assert_bit_exact(orig, read_all(tmp_path / "d"))
    assert open_artifact(tmp_path / "d", "checkpoint").parents[0].path == str(tmp_path / "c")


def test_falcon_style_biases_layernorm_tied_mqa(tmp_path: Path, shard) -> None:
    orig = write_random(tmp_path / "a", FALCON, optim=False)
    proc = shard(tmp_path / "a", tmp_path / "b", "--tp", "4", "--pp", "2", "--json", check=True)
    summary = json.loads(proc.stdout)
    assert summary["tp"] == 4 and summary["pp"] == 2 and len(summary["files"]) == 8 and not summary["reused"]
    b = open_artifact(tmp_path / "b", "checkpoint")
    assert "lm_head.weight" not in b.tensors
    assert len(b.tensors["layers.1.attn.q_proj.bias"].pieces) == 4
    assert len(b.tensors["layers.1.attn.k_proj.bias"].pieces) == 1  # multi-query: replicated
    assert len(b.tensors["layers.1.attn.o_proj.bias"].pieces) == 1
    assert len(b.tensors["layers.1.mlp.down_proj.weight"].pieces) == 4
    assert "layers.1.mlp_norm.weight" not in b.tensors
    assert_bit_exact(orig, read_all(tmp_path / "b"))


def test_experts_split_over_ep_and_tp_and_back_bit_exact(tmp_path: Path, shard) -> None:
    orig = write_random(tmp_path / "a", MIXTRAL)
    shard(tmp_path / "a", tmp_path / "b", "--tp", "2", "--ep", "2", "--pp", "2", check=True)
    b = open_artifact(tmp_path / "b", "checkpoint")
    assert (b.layout.tp, b.layout.dp) == (2, 2)  # an ep rank's experts in its own file, as a run saves
    # gate [experts 4, ffn 16, hidden 16]: experts split by ep on dim 0, the ffn by tp on dim 1.
    gate = b.tensors["optim.exp_avg.layers.1.mlp.experts.gate_proj.weight"].pieces
    assert [(p.file, p.offset, p.shape) for p in gate] == [
        (f"model-pp01-tp{t:02d}-dp{e:02d}.safetensors", [2 * e, 8 * t, 0], [2, 8, 16])
        for t in range(2)
        for e in range(2)
    ]
    down = b.tensors["layers.0.mlp.experts.down_proj.weight"].pieces  # [4, hidden, ffn]: tp on dim 2
    assert sorted((p.offset, p.shape) for p in down) == [
        ([2 * e, 0, 8 * t], [2, 16, 8]) for e in range(2) for t in range(2)
    ]
    router = b.tensors["layers.0.mlp.router.weight"].pieces  # replicated, with tp 0 and ep 0
    assert [p.file for p in router] == ["model-pp00-tp00-dp00.safetensors"]
    assert_bit_exact(orig, read_all(tmp_path / "b"))
    shard(tmp_path / "b", tmp_path / "c", "--ep", "4", check=True)
    assert (
        len(open_artifact(tmp_path / "c", "checkpoint").tensors["layers.0.mlp.experts.up_proj.weight"].pieces)
        == 4
    )
    shard(tmp_path / "c", tmp_path / "d", check=True)
    assert_bit_exact(orig, read_all(tmp_path / "d"))
    assert_one_line_error(shard(tmp_path / "a", tmp_path / "e", "--ep", "3"), "ep 3", "4 experts", "--ep")
    write_random(tmp_path / "dense", CFG, optim=False)
    assert_one_line_error(shard(tmp_path / "dense", tmp_path / "f", "--ep", "2"), "no experts", "--ep")
    assert not (tmp_path / "e").exists() and not (tmp_path / "f").exists()


def test_rerun_is_idempotent_and_force_rebuilds(tmp_path: Path, shard) -> None:
    write_random(tmp_path / "a", CFG, optim=False)
    shard(tmp_path / "a", tmp_path / "b", "--tp", "2", check=True)
    before = (tmp_path / "b" / "manifest.json").read_bytes()
    proc = shard(tmp_path / "a", tmp_path / "b", "--tp", "2", "--json", check=True)
    assert json.loads(proc.stdout)["reused"] is True
    assert "reusing" in proc.stderr
    assert (tmp_path / "b" / "manifest.json").read_bytes() == before
    # Another layout into the same directory is refused without --force, rebuilt with it.
    assert_one_line_error(shard(tmp_path / "a", tmp_path / "b", "--tp", "4"), "--force")
    shard(tmp_path / "a", tmp_path / "b", "--tp", "4", "--force", check=True)
    assert open_artifact(tmp_path / "b", "checkpoint").layout.tp == 4


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--tp", "3"], ["--tp", "tp 3 does not divide the 8 attention heads"]),
        (["--tp", "16"], ["--tp", "16 does not divide the 8 attention heads"]),
        (["--pp", "6"], ["--pp", "6 pipeline stages exceed the model's 5 layers"]),
        (["--pp", "2", "--pp-layers", "2,2"], ["--pp-layers", "sum to 4, the model has 5"]),
        (["--pp", "2", "--pp-layers", "5,0"], ["--pp-layers", "at least one layer"]),
        (["--pp", "2", "--pp-layers", "2,x"], ["--pp-layers", "comma-separated"]),
        (["--verify", "md5"], ["--verify"]),
    ],
)
def test_impossible_layouts_are_refused_before_writing(
    tmp_path: Path, shard, args: list[str], fragments: list[str]
) -> None:
    write_random(tmp_path / "a", CFG, optim=False)
    assert_one_line_error(shard(tmp_path / "a", tmp_path / "b", *args), *fragments)
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.partial").exists()


def test_padded_vocab_and_ffn_refusals(tmp_path: Path, shard) -> None:
    import msgspec

    cfg = msgspec.structs.replace(CFG, padded_vocab_size=None, vocab_size=60)
    write_random(tmp_path / "a", cfg, optim=False)
    assert_one_line_error(shard(tmp_path / "a", tmp_path / "b", "--tp", "8"), "padded vocab size 60")
    cfg = msgspec.structs.replace(CFG, ffn_hidden_size=60)
    write_random(tmp_path / "f", cfg, optim=False)
    assert_one_line_error(shard(tmp_path / "f", tmp_path / "g", "--tp", "8"), "ffn hidden size 60")
    assert not (tmp_path / "b").exists() and not (tmp_path / "g").exists()


def test_incomplete_input_and_same_output_refused(tmp_path: Path, shard) -> None:
    write_random(tmp_path / "a", CFG, optim=False)
    assert_one_line_error(shard(tmp_path / "a", tmp_path / "a", "--force"), "is the input")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "model-pp00-tp00.safetensors").write_bytes(b"x")
    assert_one_line_error(shard(tmp_path / "half", tmp_path / "b"), "incomplete artifact")
