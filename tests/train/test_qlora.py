"""QLoRA: the frozen base's projections stored in NF4 (`"base_dtype": "nf4"`). Against an independent
reference, transformers + PEFT on the base as torchao's NF4 decodes it (1e-4 relative, loss and
every adapter gradient); a mega-train run of it, its checkpoints the adapters alone; the layouts it
does not cover refused in one line. Its layouts against one process: the equivalence tests'
`"lora": "nf4"` scenarios (dp 2 with FSDP2, pp 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from torchao.quantization import to_nf4

import hf_cases
from helpers import assert_one_line_error, run_in_process
from megacore.artifacts.run_spec import ParallelSpec
from megacore.config import LoRA, is_adapter_tensor
from megacore.models.loss import IGNORE
from megacore.models.nf4 import is_nf4
from megacore.parallel.checkpoint_io import load_checkpoint
from megacore.parallel.engine import ParallelModel
from megacore.parallel.layout import Parallelism
from megacore.parallel.mesh import build_mesh, shutdown
from runlib import greedy_completion, metrics, ok, train, write_run

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 4, 8
# Projections of whole NF4 scaler blocks (16384 values): q 256 x 256, k and v 128 x 256 (2 kv heads
# of 64), gate and up 512 x 256, down 256 x 512. The vocabulary is the tokens' tokenizer's.
DIMS = {"hidden_size": 256, "intermediate_size": 512, "vocab_size": 400}
REL = 1e-4  # against PEFT on the dequantized base: loss and adapter gradients, relative


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).norm() / b.detach().norm())


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict[str, Path]:
    """The transformers model converted, and a PEFT adapter on it (B drawn: PEFT's zero B gives A
    no gradient) imported with mega-convert peft."""
    root = tmp_path_factory.mktemp("qlora")
    hf = hf_cases.build("llama2-70b-gqa", root / "hf", **DIMS)
    return hf_cases.peft_chain(root, hf, RANK, ALPHA, TARGETS, seed=5)


def peft_on_dequantized_base(chain: dict[str, Path]) -> torch.nn.Module:
    """transformers' model, each layer projection replaced by torchao's NF4 round trip of it (blocks
    of 64, double-quantized scales in blocks of 256: QLoRA's), with the PEFT adapter, trainable."""
    model = hf_cases.load_hf(chain["hf"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." in name and name.endswith("_proj.weight"):
                p.copy_(to_nf4(p.detach(), 64, 256).get_original_weight())
    return PeftModel.from_pretrained(model, chain["peft"], is_trainable=True)


def test_qlora_computes_peft_on_the_torchao_dequantized_base(chain: dict[str, Path]) -> None:
    """Our engine in this process (a group of one) with QLoRA's base loaded from the checkpoint: its
    14 projections held as NF4 tensors, its loss and the 28 adapter gradients PEFT's on the
    dequantized base within REL."""
    theirs = peft_on_dequantized_base(chain)
    tokens = hf_cases.tokens(DIMS["vocab_size"], 16)
    loss_theirs = theirs(input_ids=tokens, labels=tokens).loss
    loss_theirs.backward()
    grads = {n: p.grad for n, p in theirs.named_parameters() if p.requires_grad}

    from megacore.checkpoint import CheckpointReader

    with CheckpointReader(chain["base"]) as ckpt:
        config = ckpt.config
    lora = LoRA(RANK, float(ALPHA), tuple(TARGETS), base_dtype="nf4")
    par = Parallelism(ParallelSpec(), "fp32", 1, attention="sdpa", lora=lora)
    pm = ParallelModel(config, par, build_mesh(), "cpu")
    try:
        load_checkpoint(chain["base"], pm, only=lambda name: not is_adapter_tensor(name))
        load_checkpoint(chain["adapter"], pm, only=is_adapter_tensor)
        assert sum(is_nf4(p) for p in pm.parameters()) == 2 * 7
        targets = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], IGNORE)], dim=1)
        step = pm.forward_backward(tokens, targets, count=int((targets != IGNORE).sum()))
        assert rel(step.loss, loss_theirs) < REL, (float(step.loss), float(loss_theirs))
        mine = {n: p.grad for n, p in pm.named_parameters() if p.requires_grad}
        assert len(mine) == len(grads) == 2 * 7 * 2
        for name, grad in mine.items():
            layer, rest = name.split(".", 2)[1:]
            module, _, tensor = rest.rpartition(".lora_")
            hf = module.replace("attn.", "self_attn.")
            want = grads[f"base_model.model.model.layers.{layer}.{hf}.lora_{tensor[0]}.default.weight"]
            assert rel(grad, want) < REL, name
    finally:
        shutdown()


def test_a_qlora_run_trains_the_adapters_on_an_nf4_base(tmp_path: Path, tokens: Path, chain) -> None:
    """mega-train continues the imported adapter on the NF4 base: its plan line counts the adapters'
    parameters, the loss falls,
    and its checkpoint holds the adapters and their moments, nothing of the base."""
    lora = {"init": str(chain["adapter"]), "base_dtype": "nf4"}
    run_json = write_run(tmp_path, tokens, init=chain["base"], lora=lora, train_steps=4,
                         checkpoint={"every": 4}, eval={"every": 0})  # fmt: skip
    out = ok(train(run_json))
    # 2 layers x rank 4 x (in + out) of q 256+256, k and v 256+128, o 256+256, gate and up 256+512,
    # down 512+256
    trained = 2 * 4 * (512 + 2 * 384 + 512 + 3 * 768)
    assert f"{trained:,} trained in LoRA adapters on an NF4 base" in out.stdout, out.stdout
    records = metrics(tmp_path / "run")
    assert len(records) == 4 and records[-1]["loss"] < records[0]["loss"], records
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "step-00000004" / "manifest.json").read_text())
    assert len(manifest["tensors"]) == 2 * 7 * 2 * 3 and all(".lora_" in n for n in manifest["tensors"])


@pytest.mark.parametrize(
    ("parallel", "world", "fragments"),
    [
        ({"tp": 2}, 2, ("$.parallel.tp", "QLoRA (base_dtype nf4) covers dp (FSDP2) and pp; tp must be 1")),
        ({"cp": 2}, 2, ("$.parallel.cp", "cp must be 1")),
        (
            {},
            4,
            (
                "$.parallel",
                "layers.0.attn.k_proj.weight (128 x 256) has scales quantized in blocks of 16384 values",
                "shards over dp 4",
            ),
        ),
    ],
    ids=["tp", "cp", "shards"],
)
def test_layouts_qlora_does_not_cover_are_one_line(
    tmp_path: Path, tokens: Path, chain, parallel: dict, world: int, fragments
) -> None:
    lora = {"init": str(chain["adapter"]), "base_dtype": "nf4"}
    run_json = write_run(tmp_path, tokens, init=chain["base"], lora=lora, parallel=parallel)
    assert_one_line_error(train(run_json, "--dry-run", "--world-size", str(world)), *fragments)
    assert not (tmp_path / "run").exists()


# A GQA model whose k_proj and v_proj are 64 x 128 (one kv head of 64): 128 NF4 blocks each, fewer
# than a scaler block of 256, so they take scaler blocks of 128 (`config.nf4_scaler_block`).
GQA = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
       "vocab_size": 400}  # fmt: skip
PROMPTS, NEW = ["The", "Once upon a time there was"], 12


def test_a_qlora_run_samples_what_its_default_merged_export_generates(tmp_path: Path, tokens: Path) -> None:
    """QLoRA on the GQA model above trains 4 steps; its samples at the last step equal transformers'
    greedy `generate` on mega-export's default merge (into the base as QLoRA held it: NF4,
    dequantized), not on the merge into the base as stored (`--merge-into original`: the run's
    samples differ from it); the adapter's manifest, the card and the PEFT export's side file say
    how the base was quantized."""
    hf = hf_cases.build("llama2-70b-gqa", tmp_path / "hf", **GQA)
    assert run_in_process("mega-convert", "hf", hf, tmp_path / "base").returncode == 0
    lora = {"targets": TARGETS, "rank": RANK, "alpha": ALPHA, "base_dtype": "nf4"}
    samples = {"prompts": PROMPTS, "every": 4, "max_new_tokens": NEW}
    run_json = write_run(tmp_path, tokens, init=tmp_path / "base", lora=lora, train_steps=4,
                         checkpoint={"every": 4}, eval={"every": 0, "samples": samples})  # fmt: skip
    ok(train(run_json))
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000004"
    manifest = json.loads((ckpt / "manifest.json").read_text())["adapter"]
    assert (manifest["base_dtype"], manifest["nf4"]) == ("nf4", {"block": 64, "scaler_block": 256})
    assert run_in_process("mega-export", ckpt, tmp_path / "nf4").returncode == 0
    assert run_in_process("mega-export", ckpt, tmp_path / "orig", "--merge-into", "original").returncode == 0
    rows = metrics(tmp_path / "run", "sample")
    assert [r["prompt"] for r in rows] == PROMPTS
    for r in rows:
        assert r["completion"] == greedy_completion(tmp_path / "nf4", r["prompt"], NEW), r
    assert any(r["completion"] != greedy_completion(tmp_path / "orig", r["prompt"], NEW) for r in rows)
    assert "merged into that NF4 base dequantized" in (tmp_path / "nf4" / "README.md").read_text()
    assert "not the NF4 one it trained on" in (tmp_path / "orig" / "README.md").read_text()
    assert run_in_process("mega-export", ckpt, tmp_path / "peft", "--adapter").returncode == 0
    side = json.loads((tmp_path / "peft" / "base_quantization.json").read_text())
    assert (side["quant_type"], side["blocksize"], side["double_quant_blocksize"]) == ("nf4", 64, 256)
    bad = run_in_process("mega-export", ckpt, tmp_path / "bad", "--adapter", "--merge-into", "nf4")
    assert_one_line_error(bad, "--merge-into", "a PEFT adapter directory is not merged")
