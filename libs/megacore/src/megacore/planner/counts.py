"""What a model counts: its parameters (every one, and those a token passes through: a mixture of
experts' differ) and its training FLOPs per token, from the naming contract's tensor list
(`megacore.parts.model_tensors`); torch-free. The dry run's summary, the model card, MFU and the
planner's step time read them."""

from __future__ import annotations

import math

from megacore.config import ModelConfig
from megacore.parts import model_tensors
from megacore.parts.moe import experts_counts, is_expert_tensor


def parameter_counts(config: ModelConfig) -> tuple[int, int]:
    """(every parameter, the parameters one token passes through): they differ for a mixture of
    experts."""
    tensors = model_tensors(config)
    total = sum(math.prod(s) for s in tensors.values())
    stacked, active = experts_counts(config, tensors)
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
    matmul += experts_counts(config, tensors)[1]  # the experts' biases too: few, and a token's own
    if config.tie_embeddings:
        matmul += math.prod(tensors["embed.weight"])
    qk_v = config.head_dim + (config.head_dim if config.latent is None else config.latent.v_head_dim)
    return 6.0 * matmul + 6.0 * config.num_layers * config.num_heads * qk_v * seq_length
