"""A mixture of experts through the chain: a tiny Mixtral from transformers converted and verified,
resharded to ep 2 x tp 2, trained under torchrun on 4 processes at ep 2 x tp 2 with sequence
parallel (router losses and expert load in the metrics), exported
to a directory transformers loads with every key, whose logits are the checkpoint's; and a router
that sends every token to the same experts, which trains and whose load says so. (The numbers
against one process: tests/parallel/test_equivalence.py; against transformers: tests/models.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import run_in_process
from hf_cases import build, load_hf
from runlib import metrics, ok, torchrun, train, write_run


def _mixtral(path: Path, **overrides) -> Path:
    return build("mixtral", path, vocab_size=400, router_aux_loss_coef=0.05, **overrides)


def _run_json(directory: Path, init: Path, tokens: Path, **overrides) -> Path:
    """A run from `init` whose load-balancing loss weighs 0.02 (the run's setting, not the model's)."""
    model = {"router_aux_loss_coef": 0.02}
    return write_run(directory, tokens, init=init, model=model, eval={"every": 6, "iters": 1}, **overrides)


@pytest.mark.dist
def test_mixtral_converts_trains_at_ep2_tp2_and_exports(tmp_path: Path, tokens: Path) -> None:
    hf = _mixtral(tmp_path / "hf")
    ckpt, ep2tp2 = tmp_path / "ckpt", tmp_path / "ckpt-ep2tp2"
    converted = run_in_process("mega-convert", "hf", hf, ckpt, check=True)
    note = "router_aux_loss_coef 0.05 is a training setting, not the model's: a run sets its own"
    assert note in converted.stderr, converted.stderr
    verified = run_in_process("mega-convert", "verify", ckpt, hf, "--seq-len", "16", check=True)
    assert verified.stdout.rstrip().endswith("PASS"), verified.stdout
    run_in_process("mega-shard", ckpt, ep2tp2, "--tp", "2", "--ep", "2", check=True)

    parallel = {"tp": 2, "ep": 2, "sequence_parallel": True}
    run_json = _run_json(tmp_path / "train", ep2tp2, tokens, parallel=parallel)
    out = ok(torchrun(4, run_json))
    assert "world 4 = tp 2 x pp 1 x dp 2 (ep 2)" in out.stdout
    assert "aux loss" in out.stdout and "expert load" in out.stdout
    # Nothing of torch's on the console: no deprecated slicing of the flattened dp (edp x ep), no
    # advice on the gradient norm's per-dim all-reduces, no FSDP2 warning on the tp logits.
    assert not out.stderr.strip(), out.stderr[-3000:]
    records = metrics(run_json.parent / "run")
    assert [r["step"] for r in records] == list(range(1, 13))
    first, last = records[0], records[-1]
    assert last["loss"] < first["loss"] - 0.5, (first["loss"], last["loss"])  # 6.2 -> 5.0 measured
    tokens_per_step = 8 * 32 * 2  # every token reaches 2 experts
    for r in records:  # top-2 of 4: between 2 (balanced) and 4 (the number of experts)
        assert 1.9 < r["aux_loss"] <= 4 and r["z_loss"] > 0, r
        assert 0 <= r["expert_load_min"] <= tokens_per_step / 4 <= r["expert_load_max"], r

    final = run_json.parent / "run" / "checkpoints" / "latest"
    exported = tmp_path / "exported"
    run_in_process("mega-export", final, exported, check=True)
    # Its card: the layout the checkpoint records, its experts split over ep 2 (dp 2 is edp 1 x ep 2).
    card = (exported / "README.md").read_text().splitlines()
    experts = "4 in every layer, top 2 per token, their routing weights renormalised to sum to 1"
    assert f"| experts | {experts} |" in card, card
    layout = "tp 2 x pp 1 x dp 2, the experts over ep 2 of the dp ranks, float32"
    assert f"| layout | {layout} |" in card, card
    model, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    # config.json's load-balancing weight: the run's (0.02), not the converted config.json's (0.05)
    assert model.config.num_local_experts == 4 and model.config.router_aux_loss_coef == 0.02
    ids = torch.randint(0, 400, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, load_hf(hf)(ids).logits, atol=1e-3)  # trained
    ok(run_in_process("mega-convert", "verify", final, exported, "--seq-len", "16"))


# hf_cases' case -> what the run sets beside `init`, and what transformers must read in the export.
CHAINS = {
    "qwen2-moe": ({}, {"mlp_only_layers": [0], "shared_expert_intermediate_size": 56}),
    # DeepSeek V3's balancing bias moved each step: the export carries it (e_score_correction_bias).
    "deepseek-v3": ({"router_bias_update": 0.001}, {"first_k_dense_replace": 2, "n_shared_experts": 1}),
}


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("case", list(CHAINS))
def test_the_chain_on_dense_layers_and_shared_experts(tmp_path: Path, tokens: Path, case: str) -> None:
    """The chain on a Qwen 2 MoE (a dense layer, a gated shared expert) and a DeepSeek V3 (latent
    attention, grouped sigmoid routing, its bias moved by the run): converted, resharded to ep 2 x
    tp 2, trained on 4 processes with sequence parallel, exported to a directory transformers
    loads with every key, equal to the checkpoint's logits."""
    beside, hf_config = CHAINS[case]
    hf = build(case, tmp_path / "hf", vocab_size=400)
    ckpt, ep2tp2 = tmp_path / "ckpt", tmp_path / "ckpt-ep2tp2"
    run_in_process("mega-convert", "hf", hf, ckpt, check=True)
    run_in_process("mega-shard", ckpt, ep2tp2, "--tp", "2", "--ep", "2", check=True)
    parallel = {"tp": 2, "ep": 2, "sequence_parallel": True}
    run_json = write_run(
        tmp_path / "train",
        tokens,
        init=ep2tp2,
        parallel=parallel,
        model=beside,
        eval={"every": 6, "iters": 1},
    )
    out = ok(torchrun(4, run_json))
    assert not out.stderr.strip(), out.stderr[-3000:]
    records = metrics(run_json.parent / "run")
    assert records[-1]["loss"] < records[0]["loss"] - 0.5, (records[0]["loss"], records[-1]["loss"])
    final, exported = run_json.parent / "run" / "checkpoints" / "latest", tmp_path / "exported"
    run_in_process("mega-export", final, exported, check=True)
    model, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    assert {k: getattr(model.config, k) for k in hf_config} == hf_config
    biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert all(b.abs().max() > 0 for b in biases)  # moved (DeepSeek), none elsewhere
    ok(run_in_process("mega-convert", "verify", final, exported, "--seq-len", "16"))


def test_a_router_sending_every_token_to_two_experts_trains_and_shows_it(
    tmp_path: Path, tokens: Path
) -> None:
    """Zero router weights: every probability ties and every token goes to the same two of the four
    experts. Training runs; step 1's load is every token on two experts and none on the others
    (coefficient of variation 1), and the balancing loss moves the router away from it."""
    hf = _mixtral(tmp_path / "hf", num_hidden_layers=1)
    model = load_hf(hf)
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight.zero_()
    model.save_pretrained(hf)
    ckpt = tmp_path / "ckpt"
    run_in_process("mega-convert", "hf", hf, ckpt, check=True)
    run_json = _run_json(tmp_path / "train", ckpt, tokens, train_steps=3, checkpoint={"every": 3})
    ok(train(run_json))
    records = metrics(run_json.parent / "run")
    step1 = records[0]
    assert (step1["expert_load_min"], step1["expert_load_max"]) == (0, 8 * 32), step1
    assert step1["expert_load_cv"] == pytest.approx(1.0) and step1["aux_loss"] == pytest.approx(2.0)
    assert records[-1]["expert_load_cv"] < 1.0, records[-1]
