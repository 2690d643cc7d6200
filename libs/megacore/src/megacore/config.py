"""The model config, torch-free (docs/architecture.md); the tensors it implies are its parts'
(`megacore.parts`).

`ModelConfig` is the `config` section of checkpoint manifests and of a run manifest's `model`. It
is resolved and checked once, when it is made or decoded: `head_dim` and `padded_vocab_size` are
always set afterwards (given, or derived: hidden_size / num_heads, and vocab_size), and an
inconsistent config (heads not divisible by the kv heads, an odd head_dim, ...) never exists, so
no consumer re-derives or re-checks them. `msgspec.structs.replace` keeps the resolved values; pass
`head_dim=None` or `padded_vocab_size=None` to derive them again.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import msgspec

from megacore.config_parts import (
    ROPE_FIELDS,
    AttentionSpec,
    BlockSpec,
    DenseMLPSpec,
    LatentAttentionSpec,
    LinearAttentionSpec,
    MLPSpec,
    MoESpec,
    NormSpec,
    RMSNormSpec,
    RopeScaling,
    RopeSpec,
    SequentialBlockSpec,
    StandardAttentionSpec,
)
from megacore.structs import Positive, PositiveFloat, Struct

# Rows of the embedding and output projection are padded to a multiple of this when converting:
# divisible by every power-of-two tensor-parallel size up to 128.
DEFAULT_PAD_MULTIPLE = 128
# Tokens per chunk of the fused loss (models/loss.py): fp32 logits stay under 64M elements (256 MiB
# of scratch) whatever the vocab size, while a chunk keeps enough rows for the matmuls to run near
# full speed. Here, torch-free, because the memory planner counts that scratch too.
LOSS_CHUNK_ELEMENTS = 1 << 26

# A layer's attention: over every earlier token, through the `sliding_window` most recent ones, or
# linear attention's state (`linear_attention`).
LayerType = Literal["full_attention", "sliding_attention", "linear_attention"]
# MLPs with a gate (gate, up, down projections): SwiGLU and GeGLU with GELU's tanh approximation.
# clamped_swiglu: gpt-oss's SwiGLU variant (`swiglu_alpha`, `swiglu_limit`).
GATED_ACTIVATIONS = ("swiglu", "geglu_tanh", "clamped_swiglu")


class ModelConfig(Struct):
    """Everything needed to build the decoder: its sizes, its parts (`norm`, `rope`, `block`,
    `attention`, `mlp`: `megacore.config_parts`) and the switches their kinds share; every family is
    a choice of these."""

    family: Literal[
        "llama",
        "mistral",
        "falcon",
        "qwen2",
        "qwen3",
        "gemma3",
        "mixtral",
        "deepseek_v3",
        "gpt_oss",
        "glm4_moe",
        "qwen3_5",
        "qwen3_next",
    ]
    vocab_size: Positive
    hidden_size: Positive
    num_layers: Positive
    num_heads: Positive
    num_kv_heads: Positive
    ffn_hidden_size: Positive
    max_seq_len: Positive = 4096
    padded_vocab_size: Positive | None = None  # None: vocab_size (resolved on construction)
    # swiglu: down(silu(gate) · up); geglu_tanh: down(gelu_tanh(gate) · up) (Gemma's
    # gelu_pytorch_tanh); gelu: down(gelu(up)) (Falcon); clamped_swiglu (gpt-oss): gate clamped
    # to at most `swiglu_limit`, up to ±`swiglu_limit`, down(gate · sigmoid(`swiglu_alpha` · gate)
    # · (up + 1)). The dense MLP's and the experts' alike.
    activation: Literal["swiglu", "gelu", "geglu_tanh", "clamped_swiglu"] = "swiglu"
    swiglu_alpha: PositiveFloat = 1.702
    swiglu_limit: PositiveFloat = 7.0
    head_dim: Positive | None = None  # None: hidden_size // num_heads (resolved on construction)
    sliding_window: Positive | None = None
    # Per layer, full or sliding-window attention (Gemma 3's local / global layers) or linear
    # attention (Qwen 3.5's); None: every layer alike, through `sliding_window` when it is set.
    # `attention_window` and `linear_layer` read it.
    layer_types: list[LayerType] | None = None
    mlp_bias: bool = False
    # The embedding's output times sqrt(hidden_size), that factor rounded to the activations' dtype
    # (Gemma).
    scale_embeddings: bool = False
    tie_embeddings: bool = False
    # The parts (`megacore.config_parts`): every norm's kind, the rotary embedding, how a block
    # arranges its norms, standard or latent attention, a dense MLP or a mixture of experts.
    norm: NormSpec = msgspec.field(default_factory=RMSNormSpec)
    rope: RopeSpec = msgspec.field(default_factory=RopeSpec)
    block: BlockSpec = msgspec.field(default_factory=SequentialBlockSpec)
    attention: AttentionSpec = msgspec.field(default_factory=StandardAttentionSpec)
    # The linear attention of the layers `layer_types` says are "linear_attention" (None: none is).
    linear_attention: LinearAttentionSpec | None = None
    mlp: MLPSpec = msgspec.field(default_factory=DenseMLPSpec)
    bos_id: int | None = None
    eos_id: int | None = None

    def __post_init__(self) -> None:
        # A ValueError here is a validation error at the config's path when decoding a manifest.
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
                )
            self.head_dim = self.hidden_size // self.num_heads
        if self.padded_vocab_size is None:
            self.padded_vocab_size = self.vocab_size
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size {self.padded_vocab_size} < vocab_size {self.vocab_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of the kv heads {self.num_kv_heads}"
            )
        self._check_latent()
        if rope_dim(self) % 2 or rope_dim(self) < 2:
            rotated = (
                "head_dim"
                if self.rope.partial_rotary_factor == 1
                else "head_dim x rope.partial_rotary_factor"
            )
            raise ValueError(
                f"{'qk_rope_head_dim' if self.latent else rotated} "
                f"{rope_dim(self)} must be even (and not 0) for rotary embeddings"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
                )
            if self.sliding_window is None and "sliding_attention" in self.layer_types:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is null")
        linear = self.layer_types is not None and "linear_attention" in self.layer_types
        if linear != (self.linear_attention is not None):
            raise ValueError(
                "layer_types has linear_attention layers but linear_attention is null"
                if linear
                else "linear_attention is set but no layer_types entry is linear_attention"
            )
        if self.activation != "clamped_swiglu" and (self.swiglu_alpha, self.swiglu_limit) != (1.702, 7.0):
            raise ValueError("swiglu_alpha and swiglu_limit are clamped_swiglu's (activation)")
        self._check_experts()

    @property
    def moe(self) -> MoESpec | None:
        """The mixture of experts of the sparse layers (None: every MLP dense)."""
        return self.mlp if isinstance(self.mlp, MoESpec) else None

    @property
    def latent(self) -> LatentAttentionSpec | None:
        """The latent attention of every layer (None: standard attention)."""
        return self.attention if isinstance(self.attention, LatentAttentionSpec) else None

    def _check_latent(self) -> None:
        latent = self.latent
        if latent is None:
            return
        if latent.qk_rope_head_dim >= self.head_dim:
            raise ValueError(
                f"qk_rope_head_dim {latent.qk_rope_head_dim} must be below head_dim {self.head_dim}"
            )
        if self.num_kv_heads != self.num_heads:
            raise ValueError("latent attention has a k and v head per q head (num_kv_heads num_heads)")
        if self.rope.partial_rotary_factor != 1:
            raise ValueError("rope.partial_rotary_factor is standard attention's (latent: qk_rope_head_dim)")

    def _check_experts(self) -> None:
        moe = self.moe
        if moe is None:
            if self.family == "mixtral":
                raise ValueError("a mixtral config needs a mixture of experts (mlp type moe)")
            return
        if self.family not in EXPERT_FAMILIES:  # those whose config.json and names carry experts
            raise ValueError(
                f"family {self.family} has no experts; a mixture of experts is family {', '.join(EXPERT_FAMILIES)}"
            )
        if self.activation not in ("swiglu", "clamped_swiglu"):
            raise ValueError("experts are SwiGLU (activation swiglu or clamped_swiglu)")
        if any(i >= self.num_layers for i in moe.dense_layers):
            raise ValueError(f"dense_layers must be layer indices below {self.num_layers}")


def pad_vocab(vocab_size: int, multiple: int = DEFAULT_PAD_MULTIPLE) -> int:
    """`vocab_size` rounded up to a multiple of `multiple`: the rows of the embedding and lm_head."""
    if multiple < 1:
        raise ValueError(f"the vocab pad multiple must be at least 1, got {multiple}")
    return math.ceil(vocab_size / multiple) * multiple


def rope_dim(config: ModelConfig) -> int:
    """The dims RoPE rotates in each head: head_dim's first `rope.partial_rotary_factor` (all of it
    by default), or latent attention's rope part."""
    if config.latent is not None:
        return config.latent.qk_rope_head_dim
    return int(config.head_dim * config.rope.partial_rotary_factor)  # transformers' rounding


def sparse_layer(config: ModelConfig, layer: int) -> bool:
    """Whether layer `layer`'s MLP is a mixture of experts (else dense)."""
    return config.moe is not None and layer not in config.moe.dense_layers


def mlp_width(config: ModelConfig, layer: int) -> int:
    """Layer `layer`'s MLP width: each expert's when sparse, else the dense MLP's."""
    if sparse_layer(config, layer) or config.moe is None or config.moe.dense_ffn_hidden_size is None:
        return config.ffn_hidden_size
    return config.moe.dense_ffn_hidden_size


def linear_layer(config: ModelConfig, layer: int) -> bool:
    """Whether layer `layer` has linear attention (`config.linear_attention`) instead of softmax."""
    return config.layer_types is not None and config.layer_types[layer] == "linear_attention"


def attention_window(config: ModelConfig, layer: int) -> int | None:
    """The window layer `layer` attends through (None: full causal attention)."""
    if config.layer_types is not None and config.layer_types[layer] != "sliding_attention":
        return None
    return config.sliding_window


def local_rope(config: ModelConfig, layer: int) -> bool:
    """Layer `layer` rotates by the local RoPE (`rope.local_theta`, unscaled), not the global one."""
    return config.rope.local_theta is not None and attention_window(config, layer) is not None


# Fields that name tokens, not shapes: two configs that differ only there build the same model.
TOKEN_ID_FIELDS = ("bos_id", "eos_id")
# The context a model trains for: what a run from a checkpoint (`model.init`) may set of its model,
# the config's settings by path -> the run manifest's `model` field that sets them. Neither changes
# a tensor, so the checkpoint's weights load as they are.
CONTEXT_FIELDS = {"max_seq_len": "max_seq_len", "rope.scaling": "rope_scaling"}

# Mixtral, Qwen 3 MoE (model_type qwen3_moe), Qwen 2 MoE (model_type qwen2_moe), DeepSeek V3, gpt-oss,
# GLM-4.5, Qwen 3.5 MoE
EXPERT_FAMILIES = ("mixtral", "qwen3", "qwen2", "deepseek_v3", "gpt_oss", "glm4_moe", "qwen3_5", "qwen3_next")

# Format version 1's model configs held a run's router settings (`RouterLosses`): their names there.
V1_ROUTER_FIELDS = {
    "router_aux_loss_coef": "aux_loss_coef",
    "router_z_loss_coef": "z_loss_coef",
    "router_bias_update": "bias_update",
}


@dataclass(frozen=True)
class RouterLosses:
    """A mixture of experts' training settings, the run's (its manifest's `model.router_*`), not the
    model's: the weights with which the load-balancing loss (Mixtral's, per layer, averaged over
    layers) and the router's z-loss join the training loss, and the step by which DeepSeek V3's
    balancing bias moves towards even loads after each step (auxiliary-loss-free balancing). 0: off.
    Megatron's `--moe-aux-loss-coef`, `--moe-z-loss-coeff`, `--moe-router-bias-update-rate`."""

    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    bias_update: float = 0.0

    def fingerprint(self) -> dict[str, str]:
        """The settings as a run's fingerprint records them (`TrainingState.fingerprint`, by the run
        manifest's field): a resume must keep them, and export reads what a model trained with."""
        return {f"$.model.{name}": json.dumps(getattr(self, ours)) for name, ours in V1_ROUTER_FIELDS.items()}

    @classmethod
    def from_fingerprint(cls, fingerprint: dict[str, str]) -> RouterLosses | None:
        """The settings a checkpoint's run trained with, from its fingerprint (None: not recorded)."""
        keys = {ours: f"$.model.{name}" for name, ours in V1_ROUTER_FIELDS.items()}
        if not all(key in fingerprint for key in keys.values()):
            return None
        return cls(**{ours: float(json.loads(fingerprint[key])) for ours, key in keys.items()})

    def check(self, config: ModelConfig) -> None:
        """ValueError, naming the run manifest's field, when `config` cannot take these settings."""
        for name, ours in V1_ROUTER_FIELDS.items():
            if getattr(self, ours) and config.moe is None:
                raise ValueError(f"$.model.{name}: the model is not a mixture of experts (mlp type moe)")
        if self.bias_update and not (config.moe and config.moe.router.bias):
            raise ValueError("$.model.router_bias_update: the model's router has no bias (mlp.router.bias)")


def with_context(
    config: ModelConfig, max_seq_len: int | None = None, rope_scaling: RopeScaling | None = None
) -> ModelConfig:
    """`config` trained for another context (context extension): `max_seq_len` and `rope_scaling`
    replaced where given, every other field kept. A scaling that reads
    original_max_position_embeddings and does not give it gets `config`'s max_seq_len, the context
    the weights were trained for. ValueError when the result is not a valid config."""
    if rope_scaling is not None:
        reads = ROPE_FIELDS[rope_scaling.type]
        if (
            "original_max_position_embeddings" in reads
            and rope_scaling.original_max_position_embeddings is None
        ):
            rope_scaling = msgspec.structs.replace(
                rope_scaling, original_max_position_embeddings=config.max_seq_len
            )
    rope = config.rope if rope_scaling is None else msgspec.structs.replace(config.rope, scaling=rope_scaling)
    return msgspec.structs.replace(
        config, max_seq_len=config.max_seq_len if max_seq_len is None else max_seq_len, rope=rope
    )


# The config's tagged parts (`megacore.config_parts`): `config_fields` names their settings by path.
PART_FIELDS = ("norm", "rope", "block", "attention", "linear_attention", "mlp")


def part_fields(name: str, part: msgspec.Struct) -> dict[str, object]:
    """A part's settings by path (`mlp.type`, `mlp.num_experts`, `mlp.router.bias`, ...; a sub-part
    it has none of, `mlp.shared_expert`, as None)."""
    out: dict[str, object] = {}

    def add(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for key, v in value.items():
                add(f"{prefix}.{key}", v)
        else:
            out[prefix] = value

    add(name, msgspec.to_builtins(part))
    return out


def config_fields(config: ModelConfig) -> dict[str, object]:
    """The config's settings by name, its parts' by path (`part_fields`): what differences, and the
    families' allow-lists, are stated in."""
    out: dict[str, object] = {}
    for name, value in msgspec.structs.asdict(config).items():
        out.update(part_fields(name, value) if name in PART_FIELDS else {name: value})
    return out


def under(path: str, paths: Iterable[str]) -> str | None:
    """The first of `paths` that a setting's `path` is or lies in (`rope.scaling` for
    `rope.scaling.factor`; `mlp` for any of the mixture's), else None."""
    return next((p for p in paths if path == p or path.startswith(f"{p}.")), None)


def config_differences(
    a: ModelConfig, b: ModelConfig, ignore: tuple[str, ...] = TOKEN_ID_FIELDS
) -> list[str]:
    """Names of the settings in which two configs differ (besides `ignore`), sorted; a part's by its
    path (`config_fields`): `mlp.type` alone where the parts are of different kinds, a sub-part
    (`mlp.shared_expert`) alone where one config has none."""
    fa, fb = config_fields(a), config_fields(b)
    missing = object()
    diff = {k for k in {*fa, *fb} if under(k, ignore) is None and fa.get(k, missing) != fb.get(k, missing)}
    # What a wider difference covers: a part of another kind its settings, a sub-part its own.
    kinds = {f"{p}.type" for p in PART_FIELDS} & diff
    covered = {k.removesuffix("type") for k in kinds} | {f"{k}." for k in diff}
    return sorted(k for k in diff if k in kinds or not any(k.startswith(c) for c in covered))


# --- names of the naming contract (its tensors and shapes: `megacore.parts.model_tensors`) ---------

LORA_A, LORA_B = "lora_A.weight", "lora_B.weight"
OPTIM_PREFIX = "optim."  # optimizer state's tensors: `optim.<kind>.<param>` (`parallel.layout`)


@dataclass(frozen=True)
class LoRA:
    """A run's resolved LoRA settings (its manifest's `lora`, or the adapter it continues;
    `megacore.models.adapters` has the rules)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]  # Hugging Face module names (PEFT's target_modules)
    dropout: float = 0.0
    rslora: bool = False
    base_dtype: str | None = None  # "nf4": QLoRA's frozen base
    # Our module names the targets adapt, every layer's (`models.adapters.modules`), for what cannot
    # import the family's name map (the torch-free planner); the run plan fills them.
    modules: tuple[str, ...] = ()

    @property
    def scale(self) -> float:
        """PEFT's: alpha / rank, or alpha / sqrt(rank) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def is_adapter_tensor(name: str) -> bool:
    """Whether a checkpoint tensor name (a moment's too) is a LoRA adapter's."""
    return name.endswith((f".{LORA_A}", f".{LORA_B}"))


# The blocks' dense projections, not a mixture's router or experts, the embedding or the output
# layer: the weights precision fp8 runs in float8 (`parallel.fp8`) and QLoRA stores in NF4.
_BLOCK_PROJECTION = re.compile(r"^layers\.\d+\.(attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def is_block_projection(name: str) -> bool:
    """Whether a parameter (checkpoint name) is one of the blocks' dense projection weights."""
    return bool(_BLOCK_PROJECTION.match(name))


# QLoRA's NF4 (`models.nf4`): an absmax scale per NF4_BLOCK values, the scales quantized to int8
# per NF4_SCALER_BLOCK with one fp32 factor each (double quantization), as QLoRA's paper and
# bitsandbytes do; torchao's NF4 tensors hold whole scaler blocks. A tensor of fewer values, or not
# a multiple of them, takes smaller scaler blocks (`nf4_scaler_block`), where bitsandbytes pads.
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256


def nf4_scaler_block(numel: int, block: int = NF4_BLOCK, scaler_block: int = NF4_SCALER_BLOCK) -> int:
    """The scaler block of an NF4 tensor of `numel` values (a multiple of `block`): `scaler_block`
    where its blocks divide into them, else the largest power of two they divide into (a 64 x 128
    k_proj, 128 blocks: 128), a function of the tensor alone, so that every layout quantizes it
    alike. `scaler_block` is a power of two."""
    return math.gcd(scaler_block, numel // block)


def nf4_bytes(numel: int, whole: int | None = None) -> int:
    """The bytes of `numel` values of an NF4 tensor of `whole` values (itself by default; a shard
    holds whole scaler blocks): 4-bit codes, an int8 scale per block and an fp32 factor per scaler
    block."""
    values = NF4_BLOCK * nf4_scaler_block(whole or numel)
    return numel // 2 + numel // NF4_BLOCK + 4 * (numel // values)
