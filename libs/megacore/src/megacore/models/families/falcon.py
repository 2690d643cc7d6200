"""Falcon: LayerNorm, GELU MLP, rotary, parallel attention, multi-query (7B) or kv groups (40B).

HF layout (FalconForCausalLM): transformer.word_embeddings, transformer.h.N.{input_layernorm |
ln_attn + ln_mlp | input_layernorm + post_attention_layernorm, self_attention.{query_key_value, dense},
mlp.{dense_h_to_4h, dense_4h_to_h}}, transformer.ln_f, lm_head (tied by default).

The fused query_key_value rows are grouped per kv head: for each of the KV groups, the H/KV query
heads of the group, then its key head, then its value head. That one rule covers every layout:
new_decoder_architecture (KV = num_kv_heads), multi_query (KV = 1: all queries, then k, then v) and
classic multi-head (KV = H: q, k, v interleaved per head). Alibi checkpoints are not supported.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from megacore.config import ModelConfig
from megacore.config_parts import LayerNormSpec
from megacore.errors import UserError
from megacore.models.families.hf_config import HFConfig, build_config, max_positions_to_hf, rope_to_hf
from megacore.models.families.tensor_map import TensorMap, linear, rename

if TYPE_CHECKING:  # torch is imported where tensors are moved: reading a config.json needs none
    import torch

MODEL_TYPES = ("falcon", "RefinedWeb", "RefinedWebModel")
ARCHITECTURE = "FalconForCausalLM"
NAME = "Falcon"
# The ModelConfig fields besides `families.SHARED_FIELDS` a Falcon config.json can set to other than
# their defaults (`families.check_expressible` refuses the rest): its norm and activation are fixed
# (layernorm with bias, gelu), its biases one `bias` switch; head_dim is always hidden / heads.
SWITCHES = (
    "norm.type",
    "norm.bias",
    "activation",
    "block.type",
    "block.norms",
    "attention.bias",
    "attention.out_bias",
    "mlp_bias",
)
# Key names of the first Falcon configs (model_type RefinedWeb / RefinedWebModel).
_ALIASES = {"num_hidden_layers": "n_layer", "num_attention_heads": "n_head", "num_kv_heads": "n_head_kv"}


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    c = HFConfig(hf, where, _ALIASES)
    if c.bool("alibi", False):
        raise UserError("$.alibi: Falcon models with ALiBi positions are not supported (rotary only)", where)
    act = c.str("activation", "gelu")
    if act != "gelu":
        raise UserError(f"$.activation: {act!r} is not supported (gelu)", where)
    hidden, heads = c.int("hidden_size"), c.int("num_attention_heads")
    new_arch = c.bool("new_decoder_architecture", False)
    parallel = c.bool("parallel_attn", True)
    if new_arch:
        kv = c.int("num_kv_heads", heads)
        if not parallel:
            raise UserError(
                "$.parallel_attn: false with new_decoder_architecture is not a valid Falcon", where
            )
        n_ln = c.data.get("num_ln_in_parallel_attn") or 2
    else:
        kv = 1 if c.bool("multi_query", True) else heads
        n_ln = 1  # the classic layout has input_layernorm only (plus post_attention_layernorm if sequential)
    if n_ln not in (1, 2):
        raise UserError(f"$.num_ln_in_parallel_attn: expected 1 or 2, got {n_ln!r}", where)
    theta, scaling = c.rope()
    bias = c.bool("bias", False)
    return build_config(
        where,
        family="falcon",
        vocab_size=c.int("vocab_size"),
        hidden_size=hidden,
        num_layers=c.int("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv,
        ffn_hidden_size=c.int("ffn_hidden_size", 4 * hidden),
        max_seq_len=c.int("max_position_embeddings", 2048),
        norm={"type": "layernorm", "eps": c.float("layer_norm_epsilon", 1e-5), "bias": True},
        activation="gelu",
        rope={"theta": theta, "scaling": scaling},
        block={"type": "parallel", "norms": n_ln} if parallel else {"type": "sequential"},
        attention={"type": "standard", "bias": bias, "out_bias": bias},
        mlp_bias=bias,
        tie_embeddings=c.bool("tie_word_embeddings", True),
        bos_id=c.opt_int("bos_token_id"),
        eos_id=c.opt_int("eos_token_id"),
    )


def _new_arch(config: ModelConfig) -> bool:
    two_norms = config.block.parallel and config.block.mlp_norm
    return two_norms or config.num_kv_heads not in (1, config.num_heads)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    if not isinstance(config.norm, LayerNormSpec) or not config.norm.bias or config.activation != "gelu":
        raise UserError(
            "Falcon needs layernorm with bias and a gelu MLP (norm.type, norm.bias, activation)", "config"
        )
    if not config.attention.bias == config.attention.out_bias == config.mlp_bias:
        raise UserError("Falcon has one `bias` switch; this config's bias switches differ", "config")
    new_arch = _new_arch(config)
    if new_arch and not config.block.parallel:
        raise UserError("Falcon kv groups need parallel attention", "config")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "falcon",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "new_decoder_architecture": new_arch,
        "multi_query": not new_arch and config.num_kv_heads == 1,
        "parallel_attn": config.block.parallel,
        "num_ln_in_parallel_attn": config.block.norms if new_arch else None,  # new_arch: parallel
        "ffn_hidden_size": config.ffn_hidden_size,
        "activation": "gelu",
        "bias": config.attention.bias,
        "alibi": False,
        "layer_norm_epsilon": config.norm.eps,
        "max_position_embeddings": max_positions_to_hf(config),
        **rope_to_hf(config),
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": config.bos_id,
        "eos_token_id": config.eos_id,
    }


def _split_qkv(t: torch.Tensor, kv: int, per_group: int, hd: int) -> tuple[torch.Tensor, ...]:
    g = t.reshape(kv, per_group + 2, hd, *t.shape[1:])
    rest = t.shape[1:]
    return (
        g[:, :per_group].reshape(kv * per_group * hd, *rest),
        g[:, per_group].reshape(kv * hd, *rest),
        g[:, per_group + 1].reshape(kv * hd, *rest),
    )


def _fuse_qkv(ts: tuple[torch.Tensor, ...], kv: int, per_group: int, hd: int) -> torch.Tensor:
    q, k, v = ts
    rest = q.shape[1:]
    parts = (q.reshape(kv, per_group, hd, *rest), k.reshape(kv, 1, hd, *rest), v.reshape(kv, 1, hd, *rest))
    import torch

    return torch.cat(parts, dim=1).reshape(-1, *rest)


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    kv, hd = config.num_kv_heads, config.head_dim
    geometry = {"kv": kv, "per_group": config.num_heads // kv, "hd": hd}
    split_one, fuse_one = partial(_split_qkv, **geometry), partial(_fuse_qkv, **geometry)

    def split(ts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return split_one(ts[0])

    def fuse(ts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (fuse_one(ts),)

    maps = [rename("transformer.word_embeddings.weight", "embed.weight")]

    def norm(hf: str, ours: str) -> None:
        maps.append(rename(f"{hf}.weight", f"{ours}.weight"))
        maps.append(rename(f"{hf}.bias", f"{ours}.bias"))

    for i in range(config.num_layers):
        hf, ours = f"transformer.h.{i}", f"layers.{i}"
        two = config.block.parallel and config.block.mlp_norm
        norm(f"{hf}.ln_attn" if two else f"{hf}.input_layernorm", f"{ours}.attn_norm")
        if two:
            norm(f"{hf}.ln_mlp", f"{ours}.mlp_norm")
        elif not config.block.parallel:
            norm(f"{hf}.post_attention_layernorm", f"{ours}.mlp_norm")
        qkv = f"{hf}.self_attention.query_key_value"
        names = tuple(f"{ours}.attn.{p}_proj" for p in "qkv")
        maps.append(TensorMap((f"{qkv}.weight",), tuple(f"{n}.weight" for n in names), split, fuse))
        if config.attention.bias:
            maps.append(TensorMap((f"{qkv}.bias",), tuple(f"{n}.bias" for n in names), split, fuse))
        linear(maps, f"{hf}.self_attention.dense", f"{ours}.attn.o_proj", config.attention.out_bias)
        linear(maps, f"{hf}.mlp.dense_h_to_4h", f"{ours}.mlp.up_proj", config.mlp_bias)
        linear(maps, f"{hf}.mlp.dense_4h_to_h", f"{ours}.mlp.down_proj", config.mlp_bias)
    norm("transformer.ln_f", "norm")
    if not config.tie_embeddings:
        maps.append(rename("lm_head.weight", "lm_head.weight"))
    return maps
