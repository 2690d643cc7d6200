"""What a model counts: its parameters (every one, and those a token passes through: a mixture of
experts' differ) and its training FLOPs per token, from the naming contract's tensor list
(`megacore.config.model_tensors`); torch-free. The dry run's summary, the model card, MFU and the
planner's step time read them."""

from __future__ import annotations

import math

from megacore.config import ModelConfig, model_tensors


def is_expert_tensor(name: str) -> bool:
    """Whether a contract name is a routed expert's (stacked on a leading experts dim)."""
    return ".mlp.experts." in name


def _experts(config: ModelConfig, tensors: dict[str, tuple[int, ...]]) -> tuple[int, int]:
    """(the experts' parameters, those of them one token passes through: `experts_per_token` of
    each layer's experts)."""
    stacked = sum(math.prod(s) for n, s in tensors.items() if is_expert_tensor(n))
    if config.num_experts is None:
        return stacked, stacked
    return stacked, stacked * config.experts_per_token // config.num_experts


def parameter_counts(config: ModelConfig) -> tuple[int, int]:
    """(every parameter, the parameters one token passes through): they differ for a mixture of
    experts."""
    tensors = model_tensors(config)
    total = sum(math.prod(s) for s in tensors.values())
    stacked, active = _experts(config, tensors)
    return total, total - stacked + active


def flops_per_token(config: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token (forward and backward, recompute not counted), PaLM's count: 6 x the
    matmul parameters (the output projection, not the embedding lookup) + 12 x layers x heads x
    head_dim x sequence length for attention scores and values (latent attention: 6 x layers x
    heads x (head_dim + v_head_dim) x sequence length, its v heads being narrower). MFU divides by this. Experts
    count as the `experts_per_token` a token passes through (the active parameters)."""
    tensors = model_tensors(config)
    matmul = sum(
        math.prod(s)
        for n, s in tensors.items()
        if n.endswith(".weight") and len(s) == 2 and n != "embed.weight" and not is_expert_tensor(n)
    )
    matmul += _experts(config, tensors)[1]  # the experts' biases too: few, and a token's own
    if config.tie_embeddings:
        matmul += math.prod(tensors["embed.weight"])
    qk_v = config.head_dim + (config.v_head_dim or config.head_dim)
    return 6.0 * matmul + 6.0 * config.num_layers * config.num_heads * qk_v * seq_length
