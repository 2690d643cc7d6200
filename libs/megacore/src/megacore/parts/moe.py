"""The mixture-of-experts part (Mixtral, Qwen 2/3 MoE, DeepSeek V3, gpt-oss): a router choosing
`experts_per_token` of `num_experts` gated experts per token (with DeepSeek V3's score bias, a
training setting moves it), their projections stacked on a leading experts dim, and a shared
expert (a dense gated MLP every token goes through) with its gate. Its tensors, where tensor
parallel splits them (each expert's ffn like a dense MLP's: gate and up on dim 1, down on dim 2,
the experts dim 0 being expert parallel's; the experts' biases [experts, out] like their weights'
rows, down's replicated; the router, its bias and the shared expert's gate replicated), what
share of its parameters a token passes through, and what it saves for backward."""

from __future__ import annotations

import math

from megacore.config import ModelConfig, mlp_width
from megacore.parts.compute import Compute, Shapes, linear
from megacore.parts.mlp import MLP_SAVES, projection_tp_dims

EXPERTS = "mlp.experts."  # the stacked experts' names, layer-relative


def tensors(out: Shapes, config: ModelConfig, at: str, layer: int) -> None:
    """`at`: "layers.<i>.mlp": the router, the stacked experts and the shared expert with its gate."""
    moe = config.moe
    hidden, ffn, experts = config.hidden_size, mlp_width(config, layer), moe.num_experts
    if moe.router.bias:  # the MoE's own parameter: before its modules' in a state dict
        out[f"{at}.router_bias"] = (experts,)
    linear(out, f"{at}.router", experts, hidden, config.mlp_bias)
    for proj, rows, cols in (("gate", ffn, hidden), ("up", ffn, hidden), ("down", hidden, ffn)):
        out[f"{at}.experts.{proj}_proj.weight"] = (experts, rows, cols)
        if config.mlp_bias:
            out[f"{at}.experts.{proj}_proj.bias"] = (experts, rows)
    if moe.shared_expert is not None:
        shared = moe.shared_expert.size
        linear(out, f"{at}.shared_expert.gate_proj", shared, hidden, False)
        linear(out, f"{at}.shared_expert.up_proj", shared, hidden, False)
        linear(out, f"{at}.shared_expert.down_proj", hidden, shared, False)
        if moe.shared_expert.gate:
            out[f"{at}.shared_expert_gate.weight"] = (1, hidden)


_TP_DIMS: dict[str, int | None] = {
    "mlp.router.weight": None, "mlp.router.bias": None, "mlp.router_bias": None,
    "mlp.shared_expert_gate.weight": None,
    f"{EXPERTS}gate_proj.weight": 1, f"{EXPERTS}up_proj.weight": 1, f"{EXPERTS}down_proj.weight": 2,
    f"{EXPERTS}gate_proj.bias": 1, f"{EXPERTS}up_proj.bias": 1, f"{EXPERTS}down_proj.bias": None,
    **projection_tp_dims("mlp.shared_expert"),
}  # fmt: skip


def tp_dims(config: ModelConfig, tp: int) -> dict[str, int | None]:
    """Layer-relative names -> the dim tp splits (None: replicated)."""
    return _TP_DIMS


def is_expert_tensor(name: str) -> bool:
    """Whether a contract name is a routed expert's (stacked on a leading experts dim)."""
    return f".{EXPERTS}" in name


def experts_counts(config: ModelConfig, tensors: Shapes) -> tuple[int, int]:
    """(the experts' parameters, those of them one token passes through: `experts_per_token` of
    each layer's experts)."""
    stacked = sum(math.prod(s) for n, s in tensors.items() if is_expert_tensor(n))
    if config.moe is None:
        return stacked, stacked
    return stacked, stacked * config.moe.experts_per_token // config.moe.num_experts


def saves(config: ModelConfig, comp: Compute, tokens: int, layer: int) -> tuple[int, int]:
    """(what the mixture saves, at tp 1 the shared expert's fused gate/up weights). Each routed
    (token, expert) row's input, its gated MLP's tensors (`MLP_SAVES`, tp-local: each expert's ffn
    is split over tp), its output before the routing weight and after it (in the compute dtype:
    `index_add_` keeps its source for backward, torch 2.13; found by
    tests/families/test_conformance.py); the router's logits and fp32 probabilities, and the int64
    indices and fp32 weights of the top-k choices; a shared expert's SwiGLU and its sigmoid gate."""
    c, h, moe = comp.c, config.hidden_size, config.moe
    routed, experts = tokens * moe.experts_per_token, moe.num_experts
    glu = MLP_SAVES[config.activation] * (mlp_width(config, layer) // comp.tp)
    routing = routed * (glu + 3 * h) * c + tokens * experts * (c + 4) + routed * (2 * 8 + 2 * 4)
    shared = (0 if moe.shared_expert is None else moe.shared_expert.size) // comp.tp
    weights = 2 * shared * h * c if comp.fast["projections"] else 0
    return routing + 4 * tokens * shared * c + 2 * tokens * c, weights
