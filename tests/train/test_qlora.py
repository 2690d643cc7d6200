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
from helpers import assert_one_line_error
from megacore.artifacts.manifest import ParallelSpec
from megacore.config import LoRA, is_adapter_tensor
from megacore.models.loss import IGNORE
from megacore.models.nf4 import is_nf4
from megacore.parallel.checkpoint_io import load_checkpoint
from megacore.parallel.engine import ParallelModel
from megacore.parallel.layout import Parallelism
from megacore.parallel.mesh import build_mesh, shutdown
from runlib import metrics, ok, train, write_run

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
            ("$.parallel", "layers.0.attn.k_proj.weight (128 x 256) in NF4 blocks of 16384 values over dp 4"),
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
