"""DeepSeek V3 (DeepseekV3ForCausalLM, model_type deepseek_v3; also Moonlight, and Kimi K2, whose
config.json names model_type kimi_k2 and the same architecture): multi-head latent attention and a mixture of experts with shared experts, as
switches of the one decoder.

Attention (MLA, `models/decoder.py`'s `LatentAttention`): q through a low-rank `q_a_proj`, its
RMSNorm `q_a_layernorm` and `q_b_proj` (or one `q_proj` when `q_lora_rank` is null); k and v from
one latent: `kv_a_proj_with_mqa` gives `kv_lora_rank` latent values, normed by `kv_a_layernorm` and
expanded per head by `kv_b_proj` into each head's `qk_nope_head_dim` of k and `v_head_dim` of v,
and `qk_rope_head_dim` more that all heads share, rotated by RoPE and appended to each head's k;
q's heads are `qk_nope_head_dim` + `qk_rope_head_dim` wide, the rotated part last. The score scale
is (qk_nope + qk_rope) ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared.
`rope_interleave` (the published configs' true) rotates each pair of adjacent dims of the rope
part; ours rotates halves, so convert moves the rope rows of `q_b_proj` / `q_proj` and
`kv_a_proj_with_mqa` into halves (even dims first, then odd) and export moves them back: the same
scores, bit-exact round trips.

Experts (`models/moe.py`): sigmoid scores; each token's choice adds `e_score_correction_bias` (ours
`mlp.router_bias`, not a gradient parameter) and is limited to the best `topk_group` of `n_group`
groups (a group scored by its two best), the weights are the plain scores of the chosen,
renormalised when `norm_topk_prob`, times `routed_scaling_factor`. `n_shared_experts` shared
experts are one ungated dense MLP of `n_shared_experts` x `moe_intermediate_size`; the first
`first_k_dense_replace` layers are dense (`intermediate_size`). DeepSeek's auxiliary-loss-free
balancing, the bias moved each step towards even loads, is the run switch `router_bias_update`.

The published checkpoints carry `num_nextn_predict_layers` (transformers: `num_mtp_layers`)
multi-token-prediction layers after the last one (`model.layers.<num_hidden_layers + i>`): not
trained here; convert leaves their tensors out with one line (`extra_tensors`), and export writes
a config without them (`num_nextn_predict_layers` 0).
"""

from __future__ import annotations

from typing import Any

from megacore.config import ModelConfig, sparse_layer
from megacore.errors import UserError
from megacore.models.families import llama
from megacore.models.families.hf_config import HFConfig, build_config, llama_style_to_hf
from megacore.models.families.tensor_map import TensorMap, linear, rename

# kimi_k2: read as DeepSeek V3 (its architecture), exported as deepseek_v3, which transformers loads.
MODEL_TYPES = ("deepseek_v3", "kimi_k2")
ARCHITECTURE = "DeepseekV3ForCausalLM"
NAME = "DeepSeek V3"
SWITCHES = (
    "head_dim", "attention.type", "attention.q_lora_rank", "attention.kv_lora_rank",
    "attention.qk_rope_head_dim", "attention.v_head_dim", "mlp.type", "mlp.num_experts",
    "mlp.experts_per_token", "mlp.router.renormalize_top_k", "mlp.dense_layers",
    "mlp.dense_ffn_hidden_size", "mlp.shared_expert.size", "mlp.router.scoring", "mlp.router.bias",
    "mlp.router.groups", "mlp.router.groups_chosen", "mlp.router.scaling",
)  # fmt: skip


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """ModelConfig from a DeepSeek V3 config.json (defaults as transformers' DeepseekV3Config)."""
    c = HFConfig(hf, where)
    if c.bool("attention_bias", False):
        raise UserError("$.attention_bias: true is not supported (DeepSeek V3 has none)", where)
    act = c.str("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"$.hidden_act: {act!r} is not supported (silu)", where)
    heads, layers = c.int("num_attention_heads", 128), c.int("num_hidden_layers", 61)
    trained = c.int("max_position_embeddings", 4096)
    theta, scaling = c.rope(trained=trained)
    nope, rope = c.int("qk_nope_head_dim", 128), c.int("qk_rope_head_dim", 64)
    width = c.int("moe_intermediate_size", 2048)
    dense = list(range(min(c.int("first_k_dense_replace", 3, minimum=0), layers)))
    q_lora = c.data.get("q_lora_rank", 1536)
    return build_config(
        where,
        family="deepseek_v3",
        vocab_size=c.int("vocab_size", 129280),
        hidden_size=c.int("hidden_size", 7168),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        ffn_hidden_size=width,
        max_seq_len=trained,
        norm={"type": "rmsnorm", "eps": c.float("rms_norm_eps", 1e-6)},
        activation="swiglu",
        head_dim=nope + rope,
        rope={"theta": theta, "scaling": scaling},
        attention={
            "type": "latent",
            "q_lora_rank": None if q_lora is None else c.int("q_lora_rank"),
            "kv_lora_rank": c.int("kv_lora_rank", 512),
            "qk_rope_head_dim": rope,
            "v_head_dim": c.int("v_head_dim", 128),
        },
        mlp=moe_from_hf(c, width, dense),
        tie_embeddings=c.bool("tie_word_embeddings", False),
        bos_id=c.opt_int("bos_token_id"),
        eos_id=c.opt_int("eos_token_id"),
    )


# DeepseekV3Config's defaults of the keys `moe_from_hf` reads.
MOE_DEFAULTS = {
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "intermediate_size": 18432,
}  # fmt: skip


def moe_from_hf(
    c: HFConfig, width: int, dense: list[int], defaults: dict[str, Any] = MOE_DEFAULTS
) -> dict[str, Any]:
    """The mixture's part: routed experts `width` wide, the shared ones as one shared expert, dense
    first layers, and the router's sigmoid scores, bias, groups and scaling (GLM-4.5's too, with
    its config class's `defaults`)."""
    shared = c.int("n_shared_experts", 1, minimum=0)
    router = {
        "scoring": "sigmoid",
        "renormalize_top_k": c.bool("norm_topk_prob", True),
        "bias": True,
        "groups": c.int("n_group", defaults["n_group"]),
        "groups_chosen": c.int("topk_group", defaults["topk_group"]),
        "scaling": c.float("routed_scaling_factor", defaults["routed_scaling_factor"]),
    }
    return {
        "type": "moe",
        "num_experts": c.int("n_routed_experts", defaults["n_routed_experts"]),
        "experts_per_token": c.int("num_experts_per_tok", defaults["num_experts_per_tok"]),
        "router": router,
        "shared_expert": {"size": shared * width} if shared else None,
        "dense_layers": dense,
        "dense_ffn_hidden_size": c.int("intermediate_size", defaults["intermediate_size"]) if dense else None,
    }


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    la = config.latent
    if la is None:
        raise UserError("DeepSeek V3 has latent attention", "config")
    return (
        llama_style_to_hf(config)
        | moe_to_hf(config, NAME)
        | {
            "architectures": [ARCHITECTURE],
            "model_type": "deepseek_v3",
            "q_lora_rank": la.q_lora_rank,
            "kv_lora_rank": la.kv_lora_rank,
            "qk_rope_head_dim": la.qk_rope_head_dim,
            "qk_nope_head_dim": config.head_dim - la.qk_rope_head_dim,
            "v_head_dim": la.v_head_dim,
            "rope_interleave": True,
            "attention_bias": False,
        }
    )


def moe_to_hf(config: ModelConfig, name: str) -> dict[str, Any]:
    """The config.json keys of a DeepSeek-style mixture (DeepSeek V3's, GLM-4.5's: `name`): sigmoid
    routing with its bias, dense first layers, whole shared experts; no multi-token prediction."""
    moe = config.moe
    if moe is None or moe.router.scoring != "sigmoid" or not moe.router.bias:
        raise UserError(f"{name} has sigmoid routing with its bias", "config")
    dense = len(moe.dense_layers)
    if moe.dense_layers != list(range(dense)):
        raise UserError(f"{name}'s dense layers are its first ones (first_k_dense_replace)", "config")
    shared, width = 0 if moe.shared_expert is None else moe.shared_expert.size, config.ffn_hidden_size
    if shared % width or (moe.shared_expert is not None and moe.shared_expert.gate):
        raise UserError(f"{name}'s shared experts are whole ungated experts (n_shared_experts)", "config")
    return {
        "hidden_act": "silu",
        "intermediate_size": moe.dense_ffn_hidden_size or width,
        "moe_intermediate_size": width,
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.experts_per_token,
        "n_shared_experts": shared // width,
        "norm_topk_prob": moe.router.renormalize_top_k,
        "first_k_dense_replace": dense,
        "n_group": moe.router.groups,
        "topk_group": moe.router.groups_chosen,
        "routed_scaling_factor": moe.router.scaling,
        "num_nextn_predict_layers": 0,
    }


def extra_tensors(config: ModelConfig, names: list[str]) -> tuple[list[str], str | None]:
    """The checkpoint's tensors convert leaves out (the multi-token-prediction layers after the
    last one), and the line that says so."""
    mtp = [n for n in names if _layer_of(n) is not None and _layer_of(n) >= config.num_layers]
    if not mtp:
        return [], None
    layers = sorted({_layer_of(n) for n in mtp})
    return mtp, (
        f"the multi-token-prediction layer{'s' * (len(layers) > 1)} {', '.join(map(str, layers))} "
        f"({len(mtp)} tensors) left out: it is not trained here, and export writes none"
    )


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") and parts[2].isdigit() else None


def _halves(rope: int, heads: int, width: int):
    """(split, fuse): rows of a weight whose every `width` rows end in `rope` rows of interleaved
    pairs, moved into halves (even dims, then odd) and back; `heads` such blocks."""

    def index(inverse: bool):
        import torch

        block = torch.arange(width)
        head = torch.cat([block[: width - rope], block[width - rope :: 2], block[width - rope + 1 :: 2]])
        if inverse:
            head = head.argsort()
        return torch.cat([head + h * width for h in range(heads)])

    return (lambda ts: (ts[0][index(False)],)), (lambda ts: (ts[0][index(True)],))


def _rope_rows(hf: str, ours: str, rope: int, heads: int, width: int) -> TensorMap:
    split, fuse = _halves(rope, heads, width)
    return TensorMap((hf,), (ours,), split, fuse)


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    la = config.latent
    rope, heads, qk = la.qk_rope_head_dim, config.num_heads, config.head_dim
    maps = [rename("model.embed_tokens.weight", "embed.weight")]
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        a, b = f"{hf}.self_attn", f"{ours}.attn"
        maps.append(rename(f"{hf}.input_layernorm.weight", f"{ours}.attn_norm.weight"))
        if la.q_lora_rank is None:
            maps.append(_rope_rows(f"{a}.q_proj.weight", f"{b}.q_proj.weight", rope, heads, qk))
        else:
            maps.append(rename(f"{a}.q_a_proj.weight", f"{b}.q_a_proj.weight"))
            maps.append(rename(f"{a}.q_a_layernorm.weight", f"{b}.q_a_norm.weight"))
            maps.append(_rope_rows(f"{a}.q_b_proj.weight", f"{b}.q_b_proj.weight", rope, heads, qk))
        latent = la.kv_lora_rank + rope  # the shared rope rows last: one block
        maps.append(_rope_rows(f"{a}.kv_a_proj_with_mqa.weight", f"{b}.kv_a_proj.weight", rope, 1, latent))
        maps.append(rename(f"{a}.kv_a_layernorm.weight", f"{b}.kv_a_norm.weight"))
        maps.append(rename(f"{a}.kv_b_proj.weight", f"{b}.kv_b_proj.weight"))
        maps.append(rename(f"{a}.o_proj.weight", f"{b}.o_proj.weight"))
        maps.append(rename(f"{hf}.post_attention_layernorm.weight", f"{ours}.mlp_norm.weight"))
        if sparse_layer(config, i):
            maps.extend(llama.moe_experts(config, hf, ours))
        else:
            for p in llama.MLP_NAMES:
                linear(maps, f"{hf}.mlp.{p}", f"{ours}.mlp.{p}", False)
    maps.append(rename("model.norm.weight", "norm.weight"))
    if not config.tie_embeddings:
        maps.append(rename("lm_head.weight", "lm_head.weight"))
    return maps
