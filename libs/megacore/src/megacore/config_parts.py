"""The model config's tagged parts (`ModelConfig.attention`, `ModelConfig.mlp`): what kind of
attention and of MLP a model's layers have, each kind with the settings only it reads, so a family is
a choice of parts and a new kind of layer is one more variant here (and its module in
`megacore.parts`: its tensors, tp rows and planner terms).

In a manifest each is an object tagged by `type`: `"attention": {"type": "latent", "kv_lora_rank":
512, ...}`, `"mlp": {"type": "moe", "num_experts": 8, "experts_per_token": 2, "router": {...}}`.
A part checks what it can alone; what it needs of the rest of the config (the layer count, the
heads, the family) `ModelConfig` checks.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from megacore.structs import Positive, PositiveFloat, Struct


class StandardAttentionSpec(Struct, tag="standard", tag_field="type"):
    """Multi-head attention with grouped kv heads (`num_kv_heads`), head_dim wide, RoPE over all of
    it; its optional switches (biases, q/k norms, sinks, windows) are the config's."""


class LatentAttentionSpec(Struct, tag="latent", tag_field="type"):
    """Multi-head latent attention (DeepSeek V2/V3): k and v expanded per head from one latent
    `kv_lora_rank` wide, q through a `q_lora_rank`-wide one (None: one projection); q's and k's heads
    are head_dim wide, their last `qk_rope_head_dim` rotated (shared by every head in k), v's heads
    `v_head_dim` wide."""

    kv_lora_rank: Positive
    qk_rope_head_dim: Positive
    v_head_dim: Positive
    q_lora_rank: Positive | None = None


class DenseMLPSpec(Struct, tag="dense", tag_field="type"):
    """One MLP of ffn_hidden_size (the config's `activation` and `mlp_bias`)."""


class RouterSpec(Struct):
    """How a mixture's router picks and weights experts: softmax (or DeepSeek V3's sigmoid) scores,
    top-k, the chosen weights renormalised to sum to 1 unless `renormalize_top_k` is false (Qwen 3
    MoE's norm_topk_prob); with `bias`, a per-expert bias added to the scores a token chooses by, not
    to its weights ("mlp.router_bias", moved towards even loads by the run's
    `RouterLosses.bias_update`: auxiliary-loss-free balancing); the choice within the best
    `groups_chosen` of `groups` groups of experts; the weights times `scaling`."""

    scoring: Literal["softmax", "sigmoid"] = "softmax"
    renormalize_top_k: bool = True
    bias: bool = False
    groups: Positive | None = None
    groups_chosen: Positive | None = None
    scaling: PositiveFloat = 1.0

    def __post_init__(self) -> None:
        if (self.groups is None) != (self.groups_chosen is None):
            raise ValueError("router groups and groups_chosen are set together or not at all")
        if self.groups is not None and self.groups_chosen > self.groups:
            raise ValueError(f"router groups_chosen {self.groups_chosen} exceeds groups {self.groups}")


class SharedExpertSpec(Struct):
    """An expert every token goes through beside the routed ones (Qwen 2 MoE, DeepSeek V3): a SwiGLU
    `size` wide, its output times sigmoid(a linear of the input) when `gate`."""

    size: Positive
    gate: bool = False


class MoESpec(Struct, tag="moe", tag_field="type"):
    """A sparse mixture of experts (Mixtral, Qwen 2/3 MoE, DeepSeek V3, gpt-oss): `num_experts`
    SwiGLU experts of ffn_hidden_size each, `experts_per_token` of them chosen per token by the
    `router`. `mlp_bias` (gpt-oss): the router's linear has a bias and each expert's projections
    theirs. Layers in `dense_layers` (Qwen 3 MoE's mlp_only_layers, DeepSeek V3's first ones) have a
    dense SwiGLU instead, `dense_ffn_hidden_size` wide (None: ffn_hidden_size). Its training settings
    (the router losses' weights, the bias update) are the run's (`RouterLosses`)."""

    num_experts: Positive
    experts_per_token: Positive
    router: RouterSpec = msgspec.field(default_factory=RouterSpec)
    shared_expert: SharedExpertSpec | None = None
    dense_layers: list[Annotated[int, msgspec.Meta(ge=0)]] = msgspec.field(default_factory=list)
    dense_ffn_hidden_size: Positive | None = None

    def __post_init__(self) -> None:
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"experts_per_token {self.experts_per_token} exceeds num_experts {self.num_experts}"
            )
        if sorted(set(self.dense_layers)) != self.dense_layers:
            raise ValueError("dense_layers must be increasing layer indices")
        groups, chosen = self.router.groups, self.router.groups_chosen
        if groups is not None and self.num_experts % groups:
            raise ValueError(f"router groups {groups} must divide num_experts {self.num_experts}")
        if groups is not None and (self.num_experts // groups) * chosen < self.experts_per_token:
            raise ValueError("the router's chosen groups hold fewer experts than experts_per_token")


AttentionSpec = StandardAttentionSpec | LatentAttentionSpec
MLPSpec = DenseMLPSpec | MoESpec
