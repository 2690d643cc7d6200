"""The model config's tagged parts (`ModelConfig.norm`, `.rope`, `.block`, `.attention`, `.mlp`):
what kind of norm, rotary embedding, block arrangement, attention and MLP a model's layers have, each
kind with the settings only it reads, so a family is a choice of parts and a new kind of layer is
one more variant here (and its module in `megacore.parts`: its tensors, tp rows and planner terms).

In a manifest each is an object, the kinds tagged by `type`: `"norm": {"type": "layernorm", "eps":
1e-05, "bias": true}`, `"block": {"type": "parallel", "norms": 2}`, `"attention": {"type": "latent",
"kv_lora_rank": 512, ...}`, `"mlp": {"type": "moe", "num_experts": 8, "experts_per_token": 2,
"router": {...}}`; `"rope": {"theta": 10000.0, "scaling": {...}, "local_theta": null}` has one kind.
A part checks what it can alone; what it needs of the rest of the config (the layer count, the
heads, the family) `ModelConfig` checks.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from megacore.structs import Positive, PositiveFloat, Struct

# --- norm ----------------------------------------------------------------------------------------


class RMSNormSpec(Struct, tag="rmsnorm", tag_field="type"):
    """RMSNorm: x / rms(x) · weight."""

    eps: PositiveFloat = 1e-5


class LayerNormSpec(Struct, tag="layernorm", tag_field="type"):
    """LayerNorm (Falcon), with a bias beside its weight when `bias`."""

    eps: PositiveFloat = 1e-5
    bias: bool = False


class PlusOneRMSNormSpec(Struct, tag="rmsnorm_plus1", tag_field="type"):
    """Gemma's RMSNorm: x / rms(x) · (1 + weight), all in fp32 and rounded once; its weights stored
    as Gemma stores them (0 is the identity scale)."""

    eps: PositiveFloat = 1e-5


# Every norm of the model is of this kind: the blocks', the final one, and the q/k norms.
NormSpec = RMSNormSpec | LayerNormSpec | PlusOneRMSNormSpec

# --- rope ----------------------------------------------------------------------------------------

RopeType = Literal["linear", "dynamic", "llama3", "yarn"]
# The fields each RoPE scaling type reads besides `type` and `factor`; a field of another type is
# refused, so a config never carries a number that does nothing.
ROPE_FIELDS: dict[str, tuple[str, ...]] = {
    "linear": (),
    "dynamic": ("original_max_position_embeddings",),
    "llama3": ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "yarn": (
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
}
_ROPE_OPTIONAL = tuple(dict.fromkeys(name for names in ROPE_FIELDS.values() for name in names))


class RopeScaling(Struct, omit_defaults=True):
    """RoPE scaling (its unset fields left out of manifests, as before yarn's were added), each type as transformers' `modeling_rope_utils` computes it (`models/rope.py`):
    `linear` divides every frequency by `factor`; `dynamic` (NTK) stretches the base once a sequence
    outgrows `original_max_position_embeddings` (None: the config's max_seq_len); `llama3` (Llama
    3.1) divides the long wavelengths, keeps the short ones, with a ramp between; `yarn` (YaRN)
    interpolates by how many turns a frequency makes over the original context (a ramp from
    `beta_slow` to `beta_fast` turns; `truncate` rounds its ends) and scales cos and sin by
    `attention_factor`. YaRN's optional fields left None take transformers' defaults: beta_fast 32,
    beta_slow 1, truncate true, attention_factor 0.1 ln(factor) + 1, or the ratio of that form with
    `mscale` and with `mscale_all_dim` when both are set. `original_max_position_embeddings`, the
    context the weights were pretrained for, is needed by llama3 and yarn (`RopeSpec` checks)."""

    type: RopeType
    factor: PositiveFloat
    original_max_position_embeddings: Positive | None = None
    low_freq_factor: PositiveFloat | None = None
    high_freq_factor: PositiveFloat | None = None
    attention_factor: PositiveFloat | None = None
    beta_fast: PositiveFloat | None = None
    beta_slow: PositiveFloat | None = None
    mscale: PositiveFloat | None = None
    mscale_all_dim: PositiveFloat | None = None
    truncate: bool | None = None

    def __post_init__(self) -> None:
        if self.factor < 1:  # a factor below 1 would squeeze the trained positions, not stretch them
            raise ValueError(
                f"rope_scaling factor {self.factor:g} is below 1; a scaling stretches the context"
            )
        if self.type == "llama3" and None in (self.low_freq_factor, self.high_freq_factor):
            raise ValueError("llama3 rope scaling needs low_freq_factor and high_freq_factor")
        reads = ROPE_FIELDS[self.type]
        for name in _ROPE_OPTIONAL:
            if getattr(self, name) is not None and name not in reads:
                raise ValueError(
                    f"{self.type} rope scaling has no {name} (it reads factor"
                    + "".join(f", {f}" for f in reads)
                    + ")"
                )


class RopeSpec(Struct):
    """Rotary position embeddings over `config.rope_dim` dims of each head: base `theta`, stretched
    by `scaling` (None: none); `local_theta` (Gemma 3's local RoPE) the sliding layers' own base,
    unscaled, `theta` and `scaling` then the full-attention layers' only (None: every layer alike).
    `partial_rotary_factor` (GLM-4.5's 0.5): standard attention rotates the first
    int(head_dim x factor) dims of each q and k head and passes the rest through, as transformers'
    partial rotary does."""

    theta: PositiveFloat = 10000.0
    scaling: RopeScaling | None = None
    local_theta: PositiveFloat | None = None
    partial_rotary_factor: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0

    def __post_init__(self) -> None:
        s = self.scaling
        if s is not None and s.type in ("llama3", "yarn") and s.original_max_position_embeddings is None:
            raise ValueError(
                f"rope scaling: {s.type} needs original_max_position_embeddings, the context the "
                "weights were pretrained for"
            )


# --- block ---------------------------------------------------------------------------------------


class SequentialBlockSpec(Struct, tag="sequential", tag_field="type"):
    """Attention, then the MLP, a norm before each; with `sandwich_norm` (Gemma 2/3) one after each
    too, before it joins the residual stream (`attn_post_norm`, `mlp_post_norm`)."""

    sandwich_norm: bool = False

    @property
    def parallel(self) -> bool:
        return False

    @property
    def mlp_norm(self) -> bool:
        """Whether the MLP reads its input through a norm of its own."""
        return True


class ParallelBlockSpec(Struct, tag="parallel", tag_field="type"):
    """Attention and MLP read the same input and add to the residual together (Falcon), through one
    shared norm or one each (`norms`, Falcon's num_ln_in_parallel_attn)."""

    norms: Literal[1, 2] = 1

    @property
    def parallel(self) -> bool:
        return True

    @property
    def sandwich_norm(self) -> bool:
        return False

    @property
    def mlp_norm(self) -> bool:
        return self.norms == 2


BlockSpec = SequentialBlockSpec | ParallelBlockSpec

# --- attention -----------------------------------------------------------------------------------


class StandardAttentionSpec(Struct, tag="standard", tag_field="type"):
    """Multi-head attention with grouped kv heads (`num_kv_heads`), head_dim wide, RoPE over all of
    it. `bias`: q, k and v projections with biases; `out_bias`: the output projection too.
    `qk_norm` (Qwen 3, Gemma 3): a norm over each q and k head (head_dim wide, one weight for all
    q heads, one for all k heads), before RoPE. `sinks` (gpt-oss): a learned logit per head
    ("attn.sinks.weight" [heads]) in every softmax's denominator, with no value: a query may attend
    to nothing. `scalar` (Gemma's query_pre_attn_scalar): scores scaled by scalar ** -0.5 (None:
    head_dim's). `output_gate` (Qwen 3.5, Qwen3-Next): the heads' output times sigmoid of a gate
    projection of the input ("attn.gate_proj", one gate per q dim), before the output projection.
    Its windows are per layer (the config's `sliding_window`, `layer_types`)."""

    bias: bool = False
    out_bias: bool = False
    qk_norm: bool = False
    sinks: bool = False
    scalar: PositiveFloat | None = None
    output_gate: bool = False


class LatentAttentionSpec(Struct, tag="latent", tag_field="type"):
    """Multi-head latent attention (DeepSeek V2/V3): k and v expanded per head from one latent
    `kv_lora_rank` wide, q through a `q_lora_rank`-wide one (None: one projection); q's and k's heads
    are head_dim wide, their last `qk_rope_head_dim` rotated (shared by every head in k), v's heads
    `v_head_dim` wide."""

    kv_lora_rank: Positive
    qk_rope_head_dim: Positive
    v_head_dim: Positive
    q_lora_rank: Positive | None = None


class GatedDeltaNetSpec(Struct, tag="gated_deltanet", tag_field="type"):
    """Gated DeltaNet linear attention (Qwen 3.5, Qwen3-Next; `models.linear_attention`): q and k
    in `key_heads` heads `key_head_dim` wide, v in `value_heads` heads `value_head_dim` wide (each k
    head serves value_heads / key_heads of them), each through a causal depthwise convolution of
    `conv_kernel` taps and SiLU, read and written by the gated delta rule's per-head state
    (`models.delta_rule`), normed per head and gated by SiLU of a projection of the input. The
    layers of this kind are the config's `layer_types` entries "linear_attention"."""

    key_heads: Positive
    value_heads: Positive
    key_head_dim: Positive
    value_head_dim: Positive
    conv_kernel: Positive = 4

    def __post_init__(self) -> None:
        if self.value_heads % self.key_heads:
            raise ValueError(
                f"linear_attention value_heads {self.value_heads} is not a multiple of key_heads {self.key_heads}"
            )


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
# The kinds of linear attention a layer may have instead (`ModelConfig.linear_attention`).
LinearAttentionSpec = GatedDeltaNetSpec
MLPSpec = DenseMLPSpec | MoESpec
