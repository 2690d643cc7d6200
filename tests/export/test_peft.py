"""LoRA against PEFT: a PEFT adapter imported with `mega-convert peft` computes PEFT's loss and
adapter gradients and takes PEFT's AdamW steps (fp32, 1e-5); `mega-export --adapter` writes a
directory PEFT loads on the transformers base with no missing or unexpected keys and our logits
(1e-4), and the merged export alone gives the same logits. Bad adapters are one line each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

import hf_cases
from helpers import assert_one_line_error, run_in_process
from megacore.checkpoint import CheckpointReader
from megacore.config import LORA_A, LoRA
from megacore.models.adapters import modules
from megacore.models.lora import add_lora, freeze_base

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, STEPS, LR = 4, 8, 3, 1e-3


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).norm() / b.detach().norm())


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama (GQA) from transformers converted; a PEFT adapter on it with B drawn (PEFT's
    zero B gives A no gradient), saved by PEFT and imported with mega-convert peft."""
    root = tmp_path_factory.mktemp("peft")
    return hf_cases.peft_chain(
        root, hf_cases.build("llama2-70b-gqa", root / "hf"), RANK, ALPHA, TARGETS, seed=3
    )


def ours(chain: dict[str, Path]) -> tuple[torch.nn.Module, dict[str, torch.nn.Parameter]]:
    """Our Decoder of the base with the imported adapter: (model, adapters by PEFT's module name)."""
    with CheckpointReader(chain["base"]) as ckpt:
        model = ckpt.decoder()
    with CheckpointReader(chain["adapter"]) as ckpt:
        info = ckpt.manifest.adapter
        lora = LoRA(info.rank, info.alpha, tuple(info.targets))
        add_lora(model, modules(model.config, lora.targets), lora.rank, lora.scale)
        freeze_base(model)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.requires_grad:
                    p.copy_(ckpt.read(name))
    return model, dict(model.named_parameters())


def peft_name(ours_name: str) -> str:
    """PEFT's in-memory parameter name of one of our adapter tensors."""
    module, _, tensor = ours_name.rpartition(".lora_")
    layer, rest = module.split(".", 2)[1], module.split(".", 2)[2]
    hf = rest.replace("attn.", "self_attn.")
    return f"base_model.model.model.layers.{layer}.{hf}.lora_{tensor.removesuffix('.weight')}.default.weight"


def test_imported_adapter_trains_as_peft_does(chain: dict[str, Path]) -> None:
    model, _ = ours(chain)
    theirs = PeftModel.from_pretrained(hf_cases.load_hf(chain["hf"]), chain["peft"], is_trainable=True)
    tokens = hf_cases.tokens(model.config.vocab_size, 16)
    mine = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    named = dict(theirs.named_parameters())
    assert len(mine) == 2 * 7 * 2 and all(named[peft_name(n)].requires_grad for n, _ in mine)
    opt_ours = torch.optim.AdamW([p for _, p in mine], lr=LR)
    opt_theirs = torch.optim.AdamW([named[peft_name(n)] for n, _ in mine], lr=LR)
    for step in range(STEPS):
        loss_theirs = theirs(input_ids=tokens, labels=tokens).loss
        targets = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], dim=1)
        loss_ours = model(tokens, targets)
        assert rel(loss_ours, loss_theirs) < 1e-5, (step, float(loss_ours), float(loss_theirs))
        loss_theirs.backward()
        loss_ours.backward()
        if step == 0:
            for n, p in mine:
                assert rel(p.grad, named[peft_name(n)].grad) < 1e-5, n
        for opt in (opt_ours, opt_theirs):
            opt.step()
            opt.zero_grad()
    for n, p in mine:
        assert rel(p.detach(), named[peft_name(n)].detach()) < 1e-5, n


def test_exported_adapter_and_merged_model_give_our_logits(chain: dict[str, Path]) -> None:
    root = chain["root"]
    assert run_in_process("mega-export", chain["adapter"], root / "out-peft", "--adapter").returncode == 0
    assert run_in_process("mega-export", chain["adapter"], root / "out-merged").returncode == 0
    config = json.loads((root / "out-peft" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", RANK, ALPHA)
    model, _ = ours(chain)
    tokens = hf_cases.tokens(model.config.vocab_size, 16)
    with torch.no_grad():
        want = model(tokens)[..., : model.config.vocab_size]
        loaded = PeftModel.from_pretrained(hf_cases.load_hf(chain["hf"]), root / "out-peft")
        assert rel(loaded(input_ids=tokens).logits, want) < 1e-4
        merged = AutoModelForCausalLM.from_pretrained(root / "out-merged", dtype=torch.float32)
        assert rel(merged(input_ids=tokens).logits, want) < 1e-4


def test_peft_loads_the_export_without_missing_or_unexpected_keys(chain: dict[str, Path]) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    root = chain["root"]
    if not (root / "out-peft").exists():
        assert run_in_process("mega-export", chain["adapter"], root / "out-peft", "--adapter").returncode == 0
    model = get_peft_model(
        hf_cases.load_hf(chain["hf"]), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS)
    )
    result = set_peft_model_state_dict(model, load_file(root / "out-peft" / "adapter_model.safetensors"))
    assert not [k for k in result.missing_keys if "lora_" in k] and not result.unexpected_keys
    with CheckpointReader(chain["adapter"]) as ckpt:
        assert sum(n.endswith(LORA_A) for n in ckpt.manifest.tensors) == 2 * 7


@pytest.mark.parametrize(
    ("change", "fragments"),
    [
        ({"use_dora": True}, ("$.use_dora", "DoRA is not supported")),
        ({"peft_type": "IA3"}, ("$.peft_type", "'IA3' is not supported")),
        ({"target_modules": "q_proj|v_proj"}, ("$.target_modules", "a regex is not supported")),
        ({"target_modules": ["q_proj", "qkv_proj"]}, ("$.target_modules", "'qkv_proj' is no module")),
    ],
    ids=["dora", "ia3", "regex", "unknown-target"],
)
def test_unsupported_adapters_are_one_line(
    tmp_path: Path, chain: dict[str, Path], change: dict, fragments
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((chain["peft"] / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, **change}))
    (bad / "adapter_model.safetensors").write_bytes(
        (chain["peft"] / "adapter_model.safetensors").read_bytes()
    )
    proc = run_in_process("mega-convert", "peft", bad, tmp_path / "out", "--base", chain["base"])
    assert_one_line_error(proc, *fragments)
    assert not (tmp_path / "out").exists()
