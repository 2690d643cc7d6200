"""Worker for the equivalence tests, run under torchrun on gloo: `dist_worker.py SCENARIOS_JSON`.

Every rank builds the single-process reference model itself (tiny, fp32, same seed), then for each
scenario the parallel model from the same weights, and asserts that the logits `evaluate` hands out
(whole vocab, once per dp rank), loss, gradients, gradient norm,
the gradients clipped by `clip_grad_norm` (max_norm CLIP times the norm: torch's clip_grad_norm_ on
the reference) match the reference within REL (norm-wise relative error), and the parameters after
three AdamW steps (on unclipped gradients) within ADAM_REL, printing one line per passed scenario
on rank 0.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile
from torchao.quantization import to_nf4

from megacore.artifacts.manifest import Adapter, BaseModel, TrainingState
from megacore.artifacts.run_spec import ParallelSpec
from megacore.config import (
    LoRA,
    ModelConfig,
    RouterLosses,
    is_adapter_tensor,
    is_block_projection,
)
from megacore.config_parts import (
    GatedDeltaNetSpec,
    LatentAttentionSpec,
    LayerNormSpec,
    MoESpec,
    ParallelBlockSpec,
    PlusOneRMSNormSpec,
    RopeScaling,
    RopeSpec,
    RouterSpec,
    SequentialBlockSpec,
    SharedExpertSpec,
    StandardAttentionSpec,
)
from megacore.models import Decoder, adapters
from megacore.models.decoder import initial_value
from megacore.models.lora import add_lora, freeze_base
from megacore.models.loss import IGNORE
from megacore.models.moe import MoE
from megacore.models.nf4 import fill, is_nf4
from megacore.parallel.checkpoint_io import load_checkpoint, save_checkpoint
from megacore.parallel.clip import clip_grad_norm
from megacore.parallel.engine import ParallelModel, Step
from megacore.parallel.layout import Parallelism
from megacore.parallel.mesh import build_mesh, init_distributed, shutdown
from megacore.parallel.pieces import box_slice, local_piece
from megacore.parallel.tp import lm_loss

REL = 1e-5
# After AdamW steps: Adam divides every gradient element by its own running RMS, so an element that
# is tiny within its tensor (a few of Falcon's k_proj.bias) moves by about lr either way and carries
# its own rounding error, not the tensor's (measured up to 1.04e-5 on fp32 layouts).
ADAM_REL = 1e-4
BF16_REL = 3e-2
# Families whose fp32 step is itself this far from exact, so a layout's can differ from one
# process's by as much: Qwen 3.5's gradients are up to 1e-4 from an fp64 step's (measured: its q/k
# convolutions, their L2 norms and the delta rule's triangular solves; tp 2 gave 1.2e-4).
FAMILY_REL = {"qwen3.5-moe": 5e-4}
BATCH, SEQ, STEPS, LR = 4, 8, 3, 1e-3
# `"lora": true` scenarios: adapters on every projection PEFT's users target, the base frozen.
LORA = LoRA(4, 8.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
# `"lora": "nf4"`: QLoRA, the base's projections stored in NF4 (on "llama-nf4", whose projections
# hold whole NF4 scaler blocks, two or more: FSDP2's shards do too at dp 2).
QLORA = dataclasses.replace(LORA, base_dtype="nf4")
# `"lora": "router"`: a mixture of experts' router (Mixtral's `gate`) adapted beside attention.
ROUTER_LORA = dataclasses.replace(LORA, targets=("q_proj", "v_proj", "gate"))
LORAS = {True: LORA, "nf4": QLORA, "router": ROUTER_LORA}
DOCS = [[3, 5], [8], [2, 2, 4], [6, 2]]  # `"packed": true` scenarios: each row's documents
FAMILIES = {
    # GQA, vocab padded (60 -> 64) so the padded columns are masked in the loss.
    "llama": ModelConfig(family="llama", vocab_size=60, padded_vocab_size=64, hidden_size=32, num_layers=4,
                         num_heads=4, num_kv_heads=2, ffn_hidden_size=64),
    # Falcon 7B style: parallel attention with one LayerNorm, multi-query, GELU, tied embeddings.
    "falcon": ModelConfig(family="falcon", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=1,
                          ffn_hidden_size=128, norm=LayerNormSpec(bias=True), activation="gelu",
                          tie_embeddings=True, block=ParallelBlockSpec()),
    # Mistral: GQA and a sliding window shorter than the sequence.
    "mistral": ModelConfig(family="mistral", vocab_size=64, hidden_size=32, num_layers=4, num_heads=4,
                           num_kv_heads=2, ffn_hidden_size=64, sliding_window=4),
    # GQA with 4 query heads per kv head: under tp 4 the 2 kv heads are replicated and each rank's
    # 2 query heads share one of them.
    "llama-gqa8": ModelConfig(family="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=8,
                              num_kv_heads=2, ffn_hidden_size=64),
    # Falcon 40B style (new_decoder_architecture): parallel attention with two LayerNorms, kv groups
    # (8 heads, 2 kv heads), with biases; untied (an lm_head under tp, unlike the tied 7B case).
    "falcon40b": ModelConfig(family="falcon", vocab_size=64, hidden_size=32, num_layers=2, num_heads=8,
                             num_kv_heads=2, ffn_hidden_size=128, norm=LayerNormSpec(bias=True),
                             activation="gelu", block=ParallelBlockSpec(norms=2),
                             attention=StandardAttentionSpec(bias=True, out_bias=True), mlp_bias=True),
    # Tied embeddings under pipeline parallel (the last stage's output layer a copy of the first's
    # embedding): Falcon 40B's architecture as Falcon ties it, and Llama 3.2 style (GQA, tied).
    "falcon40b-tied": ModelConfig(family="falcon", vocab_size=64, hidden_size=32, num_layers=4, num_heads=8,
                                  num_kv_heads=2, ffn_hidden_size=128, norm=LayerNormSpec(bias=True),
                                  activation="gelu", block=ParallelBlockSpec(norms=2), tie_embeddings=True),
    "llama-tied": ModelConfig(family="llama", vocab_size=60, padded_vocab_size=64, hidden_size=32, num_layers=4,
                              num_heads=4, num_kv_heads=2, ffn_hidden_size=64, tie_embeddings=True),
    # Qwen 2.5 small style: biases on q, k, v only, GQA (4 query heads per kv head, as 0.5B's 14 over
    # 2 would be), tied embeddings. With 4 heads of 8 a k_proj.bias element along a RoPE frequency
    # too slow to turn in 8 tokens got a pure rounding-noise gradient (6e-6 of its tensor's norm)
    # that AdamW amplified past ADAM_REL; head_dim 4 leaves none (1e-3).
    "qwen2": ModelConfig(family="qwen2", vocab_size=64, hidden_size=32, num_layers=4, num_heads=8, num_kv_heads=2,
                         ffn_hidden_size=64, attention=StandardAttentionSpec(bias=True), tie_embeddings=True),
    # Qwen 3: per-head q/k norms, head_dim 16 (not 32 / 4 heads), one kv head: under tp 2 k is
    # replicated and both ranks' q heads add to k_norm's gradient.
    "qwen3": ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=1,
                         ffn_hidden_size=64, head_dim=16, attention=StandardAttentionSpec(qk_norm=True)),
    # Gemma 3 (1B style: one kv head, tied): (1 + w) norms, four per block and on q/k heads (plain
    # ops on DTensors under sp and tp), scaled embeddings, tanh GeGLU, head_dim 16 (not 32 / 4),
    # query_pre_attn_scalar 12; local layers (window 4 < SEQ, RoPE base 100) and a global one (base
    # 10000, linear scaling): pp 2's first stage holds only local layers, its second both kinds.
    "gemma3": ModelConfig(family="gemma3", vocab_size=64, hidden_size=32, num_layers=4, num_heads=4,
                          num_kv_heads=1, ffn_hidden_size=64, head_dim=16, norm=PlusOneRMSNormSpec(eps=1e-6),
                          activation="geglu_tanh", attention=StandardAttentionSpec(qk_norm=True, scalar=12.0),
                          block=SequentialBlockSpec(sandwich_norm=True), scale_embeddings=True,
                          sliding_window=4, layer_types=["sliding_attention"] * 2 + ["full_attention",
                                                                                     "sliding_attention"],
                          rope=RopeSpec(local_theta=100.0, scaling=RopeScaling(type="linear", factor=4.0)),
                          tie_embeddings=True),
    # Mixtral: 4 experts, top-2, both router losses on. Its batch runs as MOE_CHUNKS microbatches of
    # rows (the router losses are per microbatch): dp x microbatches is 2 in every "mixtral"
    # scenario, 4 in every "mixtral4" one (the same model).
    "mixtral": ModelConfig(family="mixtral", vocab_size=64, hidden_size=32, num_layers=4, num_heads=4,
                           num_kv_heads=2, ffn_hidden_size=48, mlp=MoESpec(num_experts=4, experts_per_token=2)),
    # Qwen 2 MoE: layer 0 dense (64 wide), the others 4 experts top-2 beside a gated shared expert
    # (40 wide, split over tp like a dense MLP, its gate replicated); no q/k/v biases (qkv_bias
    # false: k's bias has a zero gradient, whose rounding AdamW turns into lr-sized steps). Under
    # pp 2 the first stage holds the dense layer and a sparse one.
    "qwen2-moe": ModelConfig(family="qwen2", vocab_size=64, hidden_size=32, num_layers=4, num_heads=4,
                             num_kv_heads=2, ffn_hidden_size=24,
                             mlp=MoESpec(num_experts=4, experts_per_token=2, router=RouterSpec(renormalize_top_k=False),
                                     dense_layers=[0], dense_ffn_hidden_size=64,
                                     shared_expert=SharedExpertSpec(size=40, gate=True))),
    # DeepSeek V3: latent attention (q's low-rank pair, 8 of 24 dims rotated, v heads 12 wide),
    # layer 0 dense, then 4 experts in 2 groups (the best 1 chosen) beside a shared one, sigmoid
    # routing scaled by 2.5 with the balancing bias moved 0.01 a step towards even loads.
    "deepseek": ModelConfig(family="deepseek_v3", vocab_size=64, hidden_size=32, num_layers=4, num_heads=4,
                            num_kv_heads=4, ffn_hidden_size=24, head_dim=24,
                            attention=LatentAttentionSpec(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12),
                            mlp=MoESpec(num_experts=4, experts_per_token=2, dense_layers=[0], dense_ffn_hidden_size=64,
                                    shared_expert=SharedExpertSpec(size=24),
                                    router=RouterSpec(scoring="sigmoid", bias=True, groups=2, groups_chosen=1, scaling=2.5))),
    # gpt-oss: a sliding layer (window 4 < SEQ) then a full one, twice; q/k/v/o biases, a sink per
    # head (split over tp with q's heads), 4 experts top-2 with biases (gate/up's split over tp, the
    # down one's added once after the sum over tp) and the clamped SwiGLU (limit 0.5: it binds),
    # the router's bias; no load-balancing loss (cp takes none).
    "gpt-oss": ModelConfig(family="gpt_oss", vocab_size=64, hidden_size=32, num_layers=4, num_heads=4,
                           num_kv_heads=2, ffn_hidden_size=24, head_dim=8,
                           attention=StandardAttentionSpec(bias=True, out_bias=True, sinks=True),
                           mlp_bias=True, activation="clamped_swiglu", swiglu_limit=0.5,
                           sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2,
                           mlp=MoESpec(num_experts=4, experts_per_token=2)),
    # GLM-4.5: GQA with q/k/v biases and q/k norms, RoPE over the first half of each head; layer 0
    # dense, then 4 experts in 2 groups (the best 1 chosen) beside a shared one, sigmoid routing with
    # the balancing bias moved 0.01 a step, scaled by 2.5.
    "glm4-moe": ModelConfig(family="glm4_moe", vocab_size=64, hidden_size=32, num_layers=4, num_heads=4,
                            num_kv_heads=2, ffn_hidden_size=24, head_dim=16,
                            attention=StandardAttentionSpec(bias=True, qk_norm=True),
                            rope=RopeSpec(partial_rotary_factor=0.5),
                            mlp=MoESpec(num_experts=4, experts_per_token=2, dense_layers=[0], dense_ffn_hidden_size=64,
                                        shared_expert=SharedExpertSpec(size=24),
                                        router=RouterSpec(scoring="sigmoid", bias=True, groups=2, groups_chosen=1,
                                                          scaling=2.5))),
    # Qwen 3.5 MoE: Gated DeltaNet (2 key heads, 4 value heads) in layers 0 and 2, full attention
    # with its output gate, q/k norms and a quarter-head RoPE in 1 and 3, (1 + w) norms; 4 experts
    # top-2 beside a gated shared one.
    "qwen3.5-moe": ModelConfig(family="qwen3_5", vocab_size=64, hidden_size=32, num_layers=4, num_heads=4,
                               num_kv_heads=2, ffn_hidden_size=24, head_dim=16, norm=PlusOneRMSNormSpec(eps=1e-6),
                               rope=RopeSpec(partial_rotary_factor=0.25),
                               attention=StandardAttentionSpec(qk_norm=True, output_gate=True),
                               linear_attention=GatedDeltaNetSpec(key_heads=2, value_heads=4, key_head_dim=8,
                                                                  value_head_dim=8),
                               layer_types=["linear_attention", "full_attention"] * 2,
                               mlp=MoESpec(num_experts=4, experts_per_token=2,
                                           shared_expert=SharedExpertSpec(size=24, gate=True))),
}  # fmt: skip
# Their training settings (the run's): Mixtral both router losses, Qwen 2 MoE the load-balancing
# one, DeepSeek V3 and GLM-4.5 their bias moved 0.01 a step, gpt-oss the z-loss (cp takes no
# load-balancing loss).
ROUTERS = {
    "mixtral": RouterLosses(aux_loss_coef=0.05, z_loss_coef=0.01),
    "qwen2-moe": RouterLosses(aux_loss_coef=0.05),
    "deepseek": RouterLosses(bias_update=0.01),
    "gpt-oss": RouterLosses(z_loss_coef=0.01),
    "glm4-moe": RouterLosses(bias_update=0.01),
    "qwen3.5-moe": RouterLosses(aux_loss_coef=0.05),
}
FAMILIES["mixtral4"] = FAMILIES["mixtral"]
ROUTERS["mixtral4"] = ROUTERS["mixtral-collapsed"] = ROUTERS["mixtral"]
FAMILIES["llama-nf4"] = ModelConfig(family="llama", vocab_size=64, hidden_size=256, num_layers=2, num_heads=4,
                                    num_kv_heads=2, ffn_hidden_size=512)  # fmt: skip
# Its router starting at zero: every probability ties and every token picks experts 0 and 1, so at
# ep 2 the second rank receives no rows at all.
FAMILIES["mixtral-collapsed"] = FAMILIES["mixtral"]
LATER = ("qwen2-moe", "deepseek", "gpt-oss", "glm4-moe", "qwen3.5-moe")  # in the order they came
MOE_CHUNKS = {
    "mixtral": 2,
    "mixtral4": 4,
    "mixtral-collapsed": 2,
    "qwen2-moe": 2,
    "deepseek": 2,
    "gpt-oss": 2,
    "glm4-moe": 2,
    "qwen3.5-moe": 2,
}
# Gradient clipping is checked with max_norm at this fraction of the reference gradient norm, so the
# clip coefficient (about 0.1) really scales every gradient.
CLIP = 0.1


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def packed(tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows as packed documents (DOCS: each row's document lengths) whose first token's target
    does not count (as a user turn's would not): the tokens, the targets with IGNORE there, and the
    positions. The dp ranks' halves of the batch count different numbers of targets (13 and 11)."""
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    return tokens, targets.masked_fill(positions == 0, IGNORE), positions


def reference_loss(
    model: Decoder, cfg: ModelConfig, router: RouterLosses, tokens, targets, positions=None, chunks: int = 1
) -> torch.Tensor:
    """The language-model loss (mean over the counted targets); a mixture of experts runs the rows
    as `chunks` microbatches, each MoE layer's router losses weighted as one process weighs them
    (their mean over layers and microbatches, times the coefficients)."""
    if cfg.moe is None:
        return lm_loss(model(tokens, positions=positions), targets, cfg.vocab_size)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for m in moes:
        m.aux_weight = router.aux_loss_coef / (len(moes) * chunks)
        m.z_weight = router.z_loss_coef / (len(moes) * chunks)
        m.stats.reset()
    parts = zip(tokens.chunk(chunks), targets.chunk(chunks),
                positions.chunk(chunks) if positions is not None else [None] * chunks, strict=True)  # fmt: skip
    total = sum(lm_loss(model(x, positions=p), y, cfg.vocab_size, reduction="sum") for x, y, p in parts)
    return total / (targets != IGNORE).sum()


def add_adapters(model: Decoder, cfg: ModelConfig, lora: LoRA) -> None:
    """`lora`'s adapters, A as PEFT starts it and B drawn (PEFT's zero B would leave A no gradient),
    and the base frozen: what a LoRA scenario's one process trains."""
    add_lora(model, adapters.modules(cfg, lora.targets), lora.rank, lora.scale)
    freeze_base(model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(initial_value(name, tuple(p.shape), cfg))
                if name.endswith("lora_B.weight"):
                    p.normal_(0.0, 0.05, generator=g)


def reference(family: str, tokens, targets, positions=None, lora: bool | str = False):
    cfg, chunks = FAMILIES[family], MOE_CHUNKS.get(family, 1)
    torch.manual_seed(0)
    model, router = Decoder(cfg, attention="sdpa"), ROUTERS.get(family, RouterLosses())
    model.init_weights()
    if lora:
        add_adapters(model, cfg, LORAS[lora])
    if family == "mixtral-collapsed":
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, MoE):
                    m.router.weight.zero_()
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if lora == "nf4":  # one QLoRA process computes with its NF4 codes' values, as torchao decodes them
        with torch.no_grad():
            for name, p in model.named_parameters():
                if is_block_projection(name):
                    p.copy_(to_nf4(p.detach(), 64, 256).get_original_weight())
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=LR)
    out = {"init": init}
    for step in range(STEPS):
        loss = reference_loss(model, cfg, router, tokens, targets, positions, chunks)
        loss.backward()
        if step == 0:
            out["loss"] = loss.detach()
            moes = [m for m in model.modules() if isinstance(m, MoE)]
            if moes:  # the router losses' mean over layers and microbatches
                out["router"] = sum(m.stats.totals()[1] for m in moes) / (len(moes) * chunks)
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            out["grads"] = {n: p.grad.detach().clone() for n, p in named}
            out["norm"] = torch.nn.utils.get_total_norm([p.grad for p in trained])
            # The clipped gradients, as one process clips them; the AdamW steps use the unclipped ones.
            out["max_norm"] = CLIP * float(out["norm"])
            norm = torch.nn.utils.clip_grad_norm_(trained, out["max_norm"])
            out["clipped"] = {n: p.grad.detach().clone() for n, p in named}
            clipped_norm = torch.nn.utils.get_total_norm(list(out["clipped"].values()))
            assert rel(norm, out["norm"]) < 1e-6 and rel(clipped_norm, torch.tensor(out["max_norm"])) < 1e-5
            with torch.no_grad():
                for n, p in named:
                    p.grad.copy_(out["grads"][n])
        opt.step()
        opt.zero_grad()
        balance(model, router)
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        out["logits"] = model(tokens, positions=positions)[..., : cfg.vocab_size]
    reference_loss(
        model, cfg, router, tokens, targets, positions, chunks
    ).backward()  # a 4th step, for resumed runs
    opt.step()
    balance(model, router)
    out["params4"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


@torch.no_grad()
def balance(model: Decoder, router: RouterLosses) -> None:
    """DeepSeek V3's auxiliary-loss-free balancing as its paper states it: after each step every
    expert's bias moves by the update rate, up when the expert got fewer of the step's tokens than
    its layer's mean, down when more."""
    for m in model.modules():
        if isinstance(m, MoE) and m.router_bias is not None:
            load = m.stats.totals()[0]
            m.router_bias += router.bias_update * torch.sign(load.mean() - load)


def first_step_checks(
    pm: ParallelModel, ref: dict, out: Step, counted: float, dp_group, pp_group, label: str, tol: float
) -> list[str]:
    """After the first step (`out`): the loss (each dp rank's mean over its `counted` targets,
    weighted by their number), the router losses, every gradient, the norm and the clipped
    gradients against the reference; the gradients are left unclipped (the AdamW steps, like the
    reference's)."""
    checks, loss = [], out.loss
    if loss is not None:
        if dp_group is not None:
            both = torch.stack([loss * counted, torch.tensor(counted)])
            dist.all_reduce(both, group=dp_group)
            loss = both[0] / both[1]
        assert rel(loss, ref["loss"]) < tol, (label, float(loss), float(ref["loss"]))
        checks.append("loss")
    if "router" in ref:  # every rank has the router report (a collective)
        got = torch.stack([out.moe["aux_loss"], out.moe["z_loss"]]).float()
        # Under cp the load-balancing loss, a product of two means over a row's tokens, is each
        # rank's part's (it is refused as a training loss there); the z-loss, one mean, is whole.
        both = pm.par.spec.cp == 1
        assert rel(got if both else got[1:], ref["router"] if both else ref["router"][1:]) < tol, (
            label,
            got,
            ref["router"],
        )
        checks.append("router-losses" if both else "z-loss")
    names = []
    for name, p in trained(pm.loaded_parameters()):  # a tied copy's gradient: the shared one
        e = rel(full(p.grad), ref["grads"][name])
        assert e < tol, (label, "grad", name, e)
        names.append(name)
    checks.append(f"grads({len(names)})")
    params = [p for p in pm.parameters() if p.requires_grad]
    with torch.no_grad():
        unclipped = [p.grad.clone() for p in params]
    norm = clip_grad_norm(params, ref["max_norm"], pp_group, pm.tied_copy)
    assert rel(norm, ref["norm"]) < tol, (label, "norm", float(norm), float(ref["norm"]))
    checks.append("grad-norm")
    for name, p in trained(pm.loaded_parameters()):
        e = rel(full(p.grad), ref["clipped"][name])
        assert e < tol, (label, "clipped grad", name, e)
    checks.append("clipped-grads")
    with torch.no_grad():
        for p, g in zip(params, unclipped, strict=True):
            p.grad.copy_(g)
    return checks


def trained(named):
    """The (name, parameter) pairs that are trained: a LoRA scenario's adapters, else all."""
    return [(n, p) for n, p in named if p.requires_grad]


def eval_checks(pm: ParallelModel, inputs: dict, want: torch.Tensor, label: str, tol: float) -> list[str]:
    """`evaluate` hands out the whole vocab's logits once per dp rank, equal to the reference's."""
    seen: list[torch.Tensor] = []
    pm.evaluate(**inputs, on_logits=lambda logits, _: seen.append(logits.float()))
    assert bool(seen) == pm.reports_logits, label
    if not seen:
        return []
    e = rel(torch.cat(seen), want)
    assert e < max(tol, ADAM_REL), (label, "eval logits", e)
    return ["eval-logits"]


def cp_gather_checks(pm: ParallelModel, inputs: dict, label: str) -> list[str]:
    """What each layer's attention gathers over the cp ranks, per token: latent attention the normed
    latent and the rotated k every head shares (kv_lora_rank + qk_rope_head_dim values), not the k
    and v expanded from them; standard attention k and v of the rank's kv heads (one where tp
    replicates them)."""
    cfg, tp, cp = pm.config, pm.par.spec.tp, pm.par.spec.cp
    if cfg.latent is not None:
        want = [(cfg.latent.kv_lora_rank + cfg.latent.qk_rope_head_dim,)]
    else:
        want = [(max(1, cfg.num_kv_heads // tp), cfg.head_dim)] * 2
    layers = sum(len(part.layers) for part in pm.parts)
    # The profiler's record of each all-gather's input: those of activations are [B, S / cp, ...]
    # (not FSDP2's flat parameter shards, nor packed rows' document ids [B, S / cp]).
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        pm.evaluate(**inputs)
    shapes = [e.input_shapes[1] for e in prof.events() if e.name == "c10d::_allgather_base_"]
    shapes = [tuple(shape) for shape in shapes if len(shape) >= 3]
    assert [shape[2:] for shape in shapes] == want * layers * pm.par.microbatches, (label, shapes)
    assert {shape[1] for shape in shapes} == {SEQ // cp}, (label, shapes)
    return ["cp-gathers"]


def run_scenario(sc: dict, refs: dict, data) -> list[str]:
    cfg = FAMILIES[sc["family"]]
    spec = ParallelSpec(
        tp=sc.get("tp", 1), pp=sc.get("pp", 1), cp=sc.get("cp", 1), schedule=sc.get("schedule", "1f1b"),
        virtual_stages=sc.get("virtual_stages", 1), sequence_parallel=sc.get("sp", False), ep=sc.get("ep", 1),
        dp_mode=sc.get("dp_mode", "fsdp"),
    )  # fmt: skip
    par = Parallelism(
        spec, precision=sc.get("precision", "fp32"),
        # Without a pipeline, microbatches are gradient accumulation: 1 runs the batch as the
        # reference does (k_proj.bias gets a pure rounding-noise gradient that AdamW amplifies).
        microbatches=sc.get("microbatches", 2 if sc.get("pp", 1) > 1 else 1),
        compile=sc.get("compile", False), recompute=sc.get("recompute", "none"), attention="sdpa",
        lora=LORAS.get(sc.get("lora")), router=ROUTERS.get(sc["family"], RouterLosses()),
    )  # fmt: skip
    mesh = build_mesh(spec.tp, spec.pp, spec.cp, spec.ep)
    ref = refs[case_of(sc)]
    tokens, targets, positions = data
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    pm = ParallelModel(cfg, par, mesh, "cpu")
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=LR)
    pp_group = mesh["pp"].get_group() if spec.pp > 1 else None
    label = json.dumps(sc, sort_keys=True)
    checks = []
    # bf16 compute (fp32 master weights and reductions) is compared loosely: it rounds activations.
    tol = BF16_REL if par.precision == "bf16" else FAMILY_REL.get(sc["family"], REL)

    def mine(local_rows) -> dict:
        """This rank's inputs (by its stages) and its rows' positions (every rank)."""
        return {
            "tokens": tokens[local_rows] if pm.has_first else None,
            "targets": targets[local_rows] if pm.has_last else None,
            "positions": None if positions is None else positions[local_rows],
        }

    def step(local_rows) -> Step:
        return pm.forward_backward(**mine(local_rows), count=int((targets != IGNORE).sum()))

    def compare_params(key: str, what: str) -> None:
        limit = max(tol, ADAM_REL)  # every stored reference is after AdamW steps
        for name, p in pm.loaded_parameters():  # a tied output copy against the embedding
            if is_nf4(local_piece(p)[2]):  # QLoRA's frozen base: its codes, not the weights
                continue
            e = rel(full(p.detach()), ref[key][name])
            assert e < limit, (label, what, name, e)
        checks.append(what)

    if "load" in sc:
        # Resume from a checkpoint another layout saved: weights, AdamW moments and step count
        # (LoRA: the adapters' alone, over the base).
        if par.lora is not None:
            load_state(pm, ref["init"])
        load_checkpoint(Path(sc["load"]), pm, opt, only=is_adapter_tensor if par.lora is not None else None)
        compare_params("params", "loaded-params")
        step(rows)
        opt.step()
        compare_params("params4", "resumed-step-matches")
        dist.barrier()
        return [f"{label}: {' '.join(checks)}"]
    load_state(pm, ref["init"])
    if par.lora is QLORA:  # the base's 14 projections (7 a layer) are NF4 tensors on this rank
        stored = [n for n, p in pm.loaded_parameters() if is_nf4(local_piece(p)[2])]
        assert len(stored) == 7 * sum(len(part.layers) for part in pm.parts), (label, stored)
        checks.append(f"nf4({len(stored)})")
    for i in range(STEPS):
        out = step(rows)
        if i == 0:
            dp_group = mesh["dp"].get_group() if dp > 1 else None
            counted = float((targets[rows] != IGNORE).sum())
            checks += first_step_checks(pm, ref, out, counted, dp_group, pp_group, label, tol)
        opt.step()
        opt.zero_grad()
    compare_params("params", "params-after-3-adamw")
    # After the steps, evaluation sees the whole vocab's logits (gathered over tp, padding dropped),
    # once per dp rank. Not for compiled blocks without tp: they would recompile for no_grad (10 s a
    # scenario on CPU); with tp (autograd kept on: `evaluate`) they are checked.
    if not (par.compile and spec.tp == 1):
        checks += eval_checks(pm, mine(rows), ref["logits"][rows], label, tol)
    if spec.cp > 1:
        checks += cp_gather_checks(pm, mine(rows), label)
    if "save" in sc:
        adapter = None
        if par.lora is not None:  # the adapters and their moments only
            base = BaseModel(path="reference", manifest_sha256="0" * 64)
            lo = par.lora
            adapter = Adapter(rank=lo.rank, alpha=lo.alpha, targets=list(lo.targets), base=base)
        save_checkpoint(Path(sc["save"]), pm, opt, TrainingState(step=STEPS), force=True, adapter=adapter)
        checks.append("saved")
    dist.barrier()
    return [f"{label}: {' '.join(checks)}"]


def _draw_order(family: str) -> tuple[int, str]:
    return (LATER.index(family) if family in LATER else -1, family)


def main() -> None:
    scenarios = json.loads(Path(sys.argv[1]).read_text())
    # A launch takes well under a minute: a hung collective prints every rank's stack and ends the
    # run after 5, rather than waiting for gloo's 10-minute timeout.
    faulthandler.dump_traceback_later(300, exit=True)
    torch.manual_seed(1)
    init_distributed()
    cases = {case_of(sc) for sc in scenarios}
    g = torch.Generator().manual_seed(42)
    data = {}
    # Families added later draw their rows last: the others' rows stay what they were.
    for fam in sorted(set(FAMILIES) - {"mixtral4", "mixtral-collapsed"}, key=_draw_order):
        v = FAMILIES[fam].vocab_size
        rows = (
            torch.randint(0, v, (BATCH, SEQ), generator=g),
            torch.randint(0, v, (BATCH, SEQ), generator=g),
        )
        data[fam, False], data[fam, True] = (*rows, None), packed(*rows)
    for packed_rows in (False, True):  # mixtral's rows
        for fam in ("mixtral4", "mixtral-collapsed"):
            data[fam, packed_rows] = data["mixtral", packed_rows]
    refs = {case: reference(case[0], *data[case[:2]], lora=case[2]) for case in sorted(cases, key=str)}
    for sc in scenarios:
        lines = run_scenario(sc, refs, data[sc["family"], sc.get("packed", False)])
        if dist.get_rank() == 0:
            print("PASS", *lines, flush=True)
    shutdown()


def case_of(sc: dict) -> tuple[str, bool, bool | str]:
    """The reference a scenario compares with: its family, packed rows or not, LoRA (or QLoRA's
    "nf4") or not."""
    return sc["family"], sc.get("packed", False), sc.get("lora", False)


@torch.no_grad()
def load_state(pm: ParallelModel, state: dict[str, torch.Tensor]) -> None:
    """Fill every local parameter with its slice of a single-process model's tensors."""
    for name, p in pm.loaded_parameters():
        offset, shape, local = local_piece(p)
        if is_nf4(local):
            fill(p, state[name], offset, shape)
        elif local.numel():
            local.copy_(box_slice(state[name], (offset, shape)))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
