"""The model card of a mixture of experts, as mega-export writes it: tiny Mixtral and Qwen 3 MoE
models from transformers, converted and exported, their cards stating the experts, how many a token
goes to and whether their weights are renormalised, the parameters (all, and active per token:
counted here on the exported model transformers loads) and that the checkpoint does not record
expert parallel. (A dense model's card, and the lineage: tests/export/test_hub.py; a card after an
ep 2 x tp 2 run: tests/train/test_moe.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from helpers import run_in_process
from hf_cases import build

# (case, experts, top k, renormalised) as hf_cases builds them
CASES = [("mixtral", 4, 2, True), ("qwen3-moe-unnormed", 8, 3, False)]


def counted(exported: Path, experts: int, k: int) -> tuple[int, int]:
    """(every parameter, those one token passes through) of the export, by transformers' names: a
    token passes through k of each layer's experts."""
    model = AutoModelForCausalLM.from_pretrained(exported)
    total = sum(p.numel() for p in model.parameters())
    stacked = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total, total - stacked + stacked * k // experts


@pytest.mark.parametrize(("case", "experts", "k", "renormalised"), CASES, ids=[c[0] for c in CASES])
def test_a_mixture_of_experts_card_states_its_experts(
    tmp_path: Path, case: str, experts: int, k: int, renormalised: bool
) -> None:
    hf, ckpt, exported = build(case, tmp_path / "hf"), tmp_path / "ckpt", tmp_path / "exported"
    run_in_process("mega-convert", "hf", hf, ckpt, check=True)
    run_in_process("mega-export", ckpt, exported, check=True)
    rows = (exported / "README.md").read_text().splitlines()
    how = "renormalised to sum to 1" if renormalised else "the softmax's, not renormalised"
    assert f"| experts | {experts} in every layer, top {k} per token, their routing weights {how} |" in rows
    total, active = counted(exported, experts, k)
    assert total > active > 0
    assert f"| parameters | {total:,} in all, {active:,} active per token |" in rows
    want = "| layout | tp 1 x pp 1 x dp 1, the experts over ep 1 of the dp ranks, float32 |"
    assert want in rows, rows


def test_a_card_states_dense_layers_and_a_shared_expert(tmp_path: Path) -> None:
    """Qwen 2 MoE (hf_cases: layer 0 dense, 4 experts top-2 not renormalised, a gated shared expert):
    the row says which layers are dense and that every token also goes through the shared expert;
    the parameters as transformers counts them (the shared expert always active)."""
    hf, ckpt, exported = build("qwen2-moe", tmp_path / "hf"), tmp_path / "ckpt", tmp_path / "exported"
    run_in_process("mega-convert", "hf", hf, ckpt, check=True)
    run_in_process("mega-export", ckpt, exported, check=True)
    rows = (exported / "README.md").read_text().splitlines()
    want = (
        "| experts | 4 in every layer but 0 (dense), top 2 per token, their routing weights the softmax's, "
        "not renormalised, beside a shared expert every token goes through (gated) |"
    )
    assert want in rows, rows
    total, active = counted(exported, 4, 2)
    assert f"| parameters | {total:,} in all, {active:,} active per token |" in rows
