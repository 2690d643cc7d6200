"""LoRA against PEFT: a PEFT adapter imported with `mega-convert peft` computes PEFT's loss and
adapter gradients and takes PEFT's AdamW steps (fp32, 1e-5); `mega-export --adapter` writes a
directory PEFT loads on the transformers base with no missing or unexpected keys and our logits
(1e-4), `AutoPeftModelForCausalLM` on the Hub model the base was converted from too, and the merged
export alone gives the same logits; `mega-convert verify` holds the adapter to PEFT's directory and
to the merged export. The tools run from another directory on an adapter moved with its base. Bad
adapters are one line each."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

import hf_cases
from helpers import assert_one_line_error, run_in_process
from megacore.artifacts import open_artifact
from megacore.checkpoint import CheckpointReader
from megacore.config import LORA_A, LoRA
from megacore.models.adapters import modules
from megacore.models.lora import add_lora, freeze_base

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, STEPS, LR = 4, 8, 3, 1e-3
REPO, REVISION = "tests/tiny-llama", "0123456789abcdef0123456789abcdef01234567"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).norm() / b.detach().norm())


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama (GQA) from transformers, where huggingface_hub's cache keeps a download of it,
    converted; a PEFT adapter on it with B drawn (PEFT's zero B gives A no gradient), saved by PEFT
    and imported with mega-convert peft."""
    root = tmp_path_factory.mktemp("peft")
    snapshot = root / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / REVISION
    return hf_cases.peft_chain(root, hf_cases.build("llama2-70b-gqa", snapshot), RANK, ALPHA, TARGETS, seed=3)


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


def moved_adapter(chain: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The PEFT adapter imported in tmp_path/work from there (relative paths), work then moved to
    tmp_path/moved (where it was is gone) and the working directory made tmp_path: the adapter as
    seen from there, relative."""
    work = tmp_path / "work"
    shutil.copytree(chain["base"], work / "base")
    monkeypatch.chdir(work)
    run_in_process("mega-convert", "peft", chain["peft"], "adapter", "--base", "base", check=True)
    monkeypatch.chdir(tmp_path)
    work.rename(tmp_path / "moved")
    return Path("moved", "adapter")


def test_exported_adapter_and_merged_model_give_our_logits(
    chain: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exported from another directory than the one the adapter was made in, after it moved with
    its base (the adapter finds it relative to itself), the merged export from a tp 2 copy of it
    (mega-shard records the base relative to the copy); PEFT's directory names the Hub model the
    base was converted from, which `AutoPeftModelForCausalLM` loads."""
    root, adapter = chain["root"], moved_adapter(chain, tmp_path, monkeypatch)
    # the Hub model is in the test's cache; offline, or a lookup past it backs off for 23 s here
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    run_in_process("mega-shard", adapter, "tp2", "--tp", "2", check=True)
    run_in_process("mega-export", adapter, root / "out-peft", "--adapter", "--force", check=True)
    run_in_process("mega-export", "tp2", root / "out-merged", "--force", check=True)
    config = json.loads((root / "out-peft" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", RANK, ALPHA)
    assert (config["base_model_name_or_path"], config["revision"]) == (REPO, REVISION)
    model, _ = ours(chain)
    tokens = hf_cases.tokens(model.config.vocab_size, 16)
    with torch.no_grad():
        want = model(tokens)[..., : model.config.vocab_size]
        loaded = PeftModel.from_pretrained(hf_cases.load_hf(chain["hf"]), root / "out-peft")
        assert rel(loaded(input_ids=tokens).logits, want) < 1e-4
        auto = AutoPeftModelForCausalLM.from_pretrained(
            root / "out-peft", cache_dir=root / "hub", local_files_only=True
        )
        assert rel(auto(input_ids=tokens).logits, want) < 1e-4
        merged = AutoModelForCausalLM.from_pretrained(root / "out-merged", dtype=torch.float32)
        assert rel(merged(input_ids=tokens).logits, want) < 1e-4


def test_verify_holds_an_adapter_to_peft_and_to_its_merged_export(
    chain: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mega-convert verify` on the adapter (moved with its base, from another directory): on its
    base as trained, against PEFT's own directory on the model the base was converted from, and
    against the merged export; a PEFT directory beside a whole model is one line."""
    root, adapter = chain["root"], moved_adapter(chain, tmp_path, monkeypatch)
    if not (root / "out-merged").exists():
        run_in_process("mega-export", adapter, root / "out-merged", check=True)
    assert open_artifact(chain["base"], "checkpoint").hf_source.repo == REPO
    for compared in (chain["peft"], root / "out-merged"):
        r = json.loads(
            run_in_process("mega-convert", "verify", adapter, compared, "--json", check=True).stdout
        )
        assert r["passed"] and r["max_abs_error"] < 1e-4, (compared, r)
    proc = run_in_process("mega-convert", "verify", chain["base"], chain["peft"])
    assert_one_line_error(proc, str(chain["peft"]), "a PEFT adapter directory", "is a whole model")


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
