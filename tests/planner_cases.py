"""The planner tests' shared cases (tests/train/test_planner*.py, and tests/test_doc_numbers.py,
which regenerates the pages' figures from them): the models' published shapes, the conditions
docs/mega-train.md's tables state, Megatron-LLM's FAQ layouts, the LoRA and mixture-of-experts
models of the page's rows and the planner's own picks for them, and the dry run in process."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from megacore import planner
from megacore.artifacts.run_spec import ParallelSpec
from megacore.config import ModelConfig
from megacore.parallel.layout import Parallelism
from megacore.planner import GiB

PAGE = Path(__file__).resolve().parents[1] / "docs" / "mega-train.md"  # its "How many GPUs" table
# The conditions the page's table states: sequence 4096, micro batch 1, global batch 64, no dp.
S, B, GLOBAL_BATCH = 4096, 1, 64


# --- the models' published shapes, Megatron-LLM's FAQ layouts -------------------------------------

# The models' published shapes (their Hugging Face config.json), sequence 4096.
LLAMA2 = {
    "family": "llama",
    "vocab_size": 32000,
    "norm": {"type": "rmsnorm", "eps": 1e-5},
    "max_seq_len": 4096,
}
SHAPES = {
    "llama2-7b": {**LLAMA2, "hidden_size": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 32,
                  "ffn_hidden_size": 11008},
    "mistral-7b": {"family": "mistral", "vocab_size": 32000, "hidden_size": 4096, "num_layers": 32,
                   "num_heads": 32, "num_kv_heads": 8, "ffn_hidden_size": 14336, "max_seq_len": 4096,
                   "norm": {"type": "rmsnorm", "eps": 1e-5}, "sliding_window": 4096},
    "falcon-40b": {"family": "falcon", "norm": {"type": "layernorm", "bias": True}, "activation": "gelu",
                   "tie_embeddings": True, "block": {"type": "parallel", "norms": 2}, "max_seq_len": 4096, "vocab_size": 65024,
                   "hidden_size": 8192, "num_layers": 60, "num_heads": 128, "num_kv_heads": 8,
                   "ffn_hidden_size": 32768},
    "llama2-70b": {**LLAMA2, "hidden_size": 8192, "num_layers": 80, "num_heads": 64, "num_kv_heads": 8,
                   "ffn_hidden_size": 28672},
}  # fmt: skip


def preset_config(name: str, **changes) -> dict:
    return msgspec.to_builtins(msgspec.convert({**SHAPES[name], **changes}, ModelConfig))


# Megatron-LLM's FAQ ("What are the basic hardware requirements?"): full fine-tuning on 80 GB GPUs,
# world = tp x pp. Falcon 40B tied, as its config.json leaves it (FalconConfig's default): under pp
# the last stage holds a copy of the embedding as its output layer, as Megatron does.
FAQ = {
    "llama2-7b": (preset_config("llama2-7b"), 2, 1),
    "mistral-7b": (preset_config("mistral-7b"), 4, 1),
    "falcon-40b": (preset_config("falcon-40b"), 8, 2),
    "llama2-70b": (preset_config("llama2-70b"), 8, 4),
}


def dry_run(capsys, *argv: object) -> tuple[int, str, str]:
    from mega_train.cli import app
    from megacore.cli import run as run_cli

    code = run_cli(app, "mega-train", [str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# Mixtral 8x7B's published shape (its config.json).
MIXTRAL_8X7B = {
    "family": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "num_layers": 32, "num_heads": 32,
    "num_kv_heads": 8, "ffn_hidden_size": 14336, "max_seq_len": 32768, "norm": {"type": "rmsnorm", "eps": 1e-5},
    "rope": {"theta": 1e6}, "mlp": {"type": "moe", "num_experts": 8, "experts_per_token": 2},
}  # fmt: skip


# --- the page's LoRA and QLoRA rows -----------------------------------------------------------------

# The page's conditions (the full fine-tuning table's batch): rank 16 (alpha 32) on every projection
# the family has of these (Mixtral: its attention), dropout 0.
LORA_MODELS = {
    "Llama 2 7B": SHAPES["llama2-7b"],
    "Llama 2 70B": SHAPES["llama2-70b"],
    "Mixtral 8×7B": MIXTRAL_8X7B,
}
LORA_RANK = 16
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_parallelism(config: ModelConfig, nf4: bool) -> Parallelism:
    """The page's LoRA (QLoRA: `nf4`) settings, its modules resolved as the run plan resolves them."""
    from megacore.config import LoRA
    from megacore.models import adapters

    targets = tuple(t for t in PROJECTIONS if t in adapters.targetable(config))
    lora = LoRA(LORA_RANK, 2.0 * LORA_RANK, targets, base_dtype="nf4" if nf4 else None,
                modules=tuple(adapters.modules(config, targets)))  # fmt: skip
    return Parallelism(ParallelSpec(), "bf16", 1, attention="auto", lora=lora)


def fewest_gpus(config: ModelConfig, nf4: bool) -> tuple[int, planner.Candidate]:
    """The fewest 80 GB GPUs (a power of 2) on which a layout fits, and the planner's first pick there."""
    for gpus in (1, 2, 4, 8, 16, 32):
        found = planner.search(
            config, lora_parallelism(config, nf4), gpus, 80 * GiB, B, S, GLOBAL_BATCH, "auto"
        )
        if found[0].fits:
            return gpus, found[0]
    raise AssertionError(f"nothing fits 32 GPUs: {config}")


# --- the page's largest mixtures of experts, full fine-tuning ---------------------------------------

# deepseek-ai/DeepSeek-V3's config.json as the Hub publishes it (its multi-token-prediction layer,
# num_nextn_predict_layers, is not trained here: mega-convert leaves it out).
DEEPSEEK_V3_CONFIG_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip


# openai/gpt-oss-120b's config.json as the Hub publishes it; gpt-oss-20b's differs in its layers
# (24) and experts (32). Its MXFP4 experts are trained here in bf16 (mega-convert dequantizes them).
def gpt_oss_config_json(layers: int, experts: int) -> dict:
    return {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
        "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
        "num_experts_per_tok": 4, "num_hidden_layers": layers, "num_key_value_heads": 8,
        "num_local_experts": experts, "output_router_logits": False, "pad_token_id": 199999,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"],
                                "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True,
        "vocab_size": 201088,
    }  # fmt: skip


# A parameter of a rank: its tp-local shape, the dim FSDP2 cuts, whether it trains (else its weights alone).
Param = tuple[tuple[int, ...], int, bool]


@dataclass(frozen=True)
class PublishedMoE:
    """A mixture of experts as its config.json publishes it: the vocab and hidden size (untied
    embedding and head, split by tp on the vocab), its layers, and a layer's parameters on a tp
    rank (`layer(tp, i)`)."""

    config_json: dict
    vocab: int
    hidden: int
    layers: int
    layer: Callable[[int, int], list[Param]]

    def stage(self, tp: int, pp: int, r: int) -> list[Param]:
        """Pipeline stage r's parameters of pp stages (an even split, the first stages one layer more
        where it does not divide): the embedding first, the norm and head last."""
        assert self.vocab % tp == 0
        table = ((self.vocab // tp, self.hidden), 0, True)
        per, extra = divmod(self.layers, pp)
        start = r * per + min(r, extra)
        out = [table] if r == 0 else []
        out += [p for i in range(start, start + per + (r < extra)) for p in self.layer(tp, i)]
        return out + ([((self.hidden,), 0, True), table] if r == pp - 1 else [])


def deepseek_v3_layer(tp: int, i: int) -> list[Param]:
    """DeepSeek V3's layer i on a tp rank: latent attention (q's rank-1536 pair, the rank-512
    latent and a 64-wide rope part, 128 heads of 128 + 64, v of 128; the per-head expansions split
    by head, the latent projections and norms whole); the first 3 layers' MLP dense (18432), the
    others 256 experts of 2048 (each expert's ffn split by tp; FSDP2 cuts gate/up's hidden dim
    under tp, their ffn dim without, down's hidden dim), a router and its balancing bias (moved by
    the engine, no gradient) and one shared expert."""
    h, heads, q_lora, latent, nope, rope, v = 7168, 128, 1536, 512, 128, 64, 128
    attention = [(h,), (q_lora, h), (q_lora,), (heads * (nope + rope) // tp, q_lora), (latent + rope, h),
                 (latent,), (heads * (nope + v) // tp, latent), (h, heads * v // tp), (h,)]  # fmt: skip
    out = [(s, 0, True) for s in attention]  # attention, its norm and the MLP's norm
    if i < 3:
        f = 18432 // tp
        return [*out, ((f, h), 0, True), ((f, h), 0, True), ((h, f), 0, True)]
    e, f, gate_up = 256, 2048 // tp, 2 if tp > 1 else 1
    return [*out, ((e,), 0, False), ((e, h), 0, True), ((e, f, h), gate_up, True), ((e, f, h), gate_up, True),
            ((e, h, f), 1, True), ((f, h), 0, True), ((f, h), 0, True), ((h, f), 0, True)]  # fmt: skip


def gpt_oss_layer(experts: int) -> Callable[[int, int], list[Param]]:
    """gpt-oss's layer on a tp rank: 64 q heads and 8 kv heads of 64 (q/k/v split by head with their
    biases, o by its columns, o's bias whole), a sink per q head (split with them), `experts`
    experts of 2880 with biases (each expert's ffn split by tp, gate's and up's biases with it,
    down's whole; FSDP2 cuts their weights as DeepSeek V3's, the biases' experts), a router with
    its bias."""

    def layer(tp: int, i: int) -> list[Param]:
        h, q, kv, e, f = 2880, 64 * 64 // tp, 8 * 64 // tp, experts, 2880 // tp
        gate_up = 2 if tp > 1 else 1
        attention = [(h,), (q, h), (q,), (kv, h), (kv,), (kv, h), (kv,), (h, q), (h,), (64 // tp,), (h,)]
        out = [(s, 0, True) for s in attention]  # attention, its sinks, the norms
        out += [((e, h), 0, True), ((e,), 0, True)]  # the router
        out += 2 * [((e, f, h), gate_up, True), ((e, f), 0 if tp > 1 else 1, True)]  # gate, up
        return [*out, ((e, h, f), 1, True), ((e, h), 1, True)]  # down

    return layer


# GLM-4.5 and GLM-4.5-Air's config.json sizes (zai-org's; their multi-token-prediction layer,
# num_nextn_predict_layers, is not trained here: mega-convert leaves it out).
GLM_45_CONFIG_JSON = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "first_k_dense_replace": 3, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 12288, "max_position_embeddings": 131072,
    "model_type": "glm4_moe", "moe_intermediate_size": 1536, "n_group": 1, "n_routed_experts": 160,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8,
    "num_hidden_layers": 92, "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000, "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False, "topk_group": 1, "use_qk_norm": True, "vocab_size": 151552,
}  # fmt: skip
GLM_45_AIR_CONFIG_JSON = GLM_45_CONFIG_JSON | {
    "first_k_dense_replace": 1, "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "n_routed_experts": 128, "num_hidden_layers": 46, "use_qk_norm": False,
}  # fmt: skip


def glm_layer(hf: dict) -> Callable[[int, int], list[Param]]:
    """A GLM-4.5 layer on a tp rank: 96 q heads and 8 kv heads of 128 with q/k/v biases (split by
    head), o by its columns, q/k norms (128 wide, whole) where `use_qk_norm`; the first
    `first_k_dense_replace` layers' MLP dense, the others `n_routed_experts` experts with a router
    and its balancing bias and one shared expert, as DeepSeek V3's."""

    def layer(tp: int, i: int) -> list[Param]:
        h, q, kv = hf["hidden_size"], 96 * 128 // tp, 8 * 128 // tp
        attention = [(h,), (q, h), (q,), (kv, h), (kv,), (kv, h), (kv,), (h, q), (h,)]
        attention += [(128,), (128,)] if hf["use_qk_norm"] else []
        out = [(s, 0, True) for s in attention]  # attention, its norm and the MLP's norm
        if i < hf["first_k_dense_replace"]:
            f = hf["intermediate_size"] // tp
            return [*out, ((f, h), 0, True), ((f, h), 0, True), ((h, f), 0, True)]
        e, f, gate_up = hf["n_routed_experts"], hf["moe_intermediate_size"] // tp, 2 if tp > 1 else 1
        return [*out, ((e,), 0, False), ((e, h), 0, True), ((e, f, h), gate_up, True), ((e, f, h), gate_up, True),
                ((e, h, f), 1, True), ((f, h), 0, True), ((f, h), 0, True), ((h, f), 0, True)]  # fmt: skip

    return layer


# Qwen 3.5's largest mixture (397B-A17B) and its 27B dense model, as their model cards give the
# language model: Gated DeltaNet in three of four layers (16 key heads, value heads 64 and 48, 128
# wide), gated attention in the fourth (32 and 24 q heads, 2 and 4 kv heads, 256 wide).
_QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10], "mrope_interleaved": True}  # fmt: skip
QWEN35_397B_CONFIG_JSON = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 4096, "num_hidden_layers": 60,
    "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 64, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024,
    "num_experts": 512, "num_experts_per_tok": 10, "full_attention_interval": 4, "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "rope_parameters": _QWEN35_ROPE,
}  # fmt: skip
QWEN35_27B_CONFIG_JSON = QWEN35_397B_CONFIG_JSON | {
    "model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64, "intermediate_size": 17408,
    "num_attention_heads": 24, "num_key_value_heads": 4, "linear_num_value_heads": 48,
}  # fmt: skip


def qwen35_layer(hf: dict) -> Callable[[int, int], list[Param]]:
    """A Qwen 3.5 layer on a tp rank: Gated DeltaNet where (i + 1) % 4 (q, k, v, z, b, a split by
    heads, q's, k's and v's convolution filters with them, dt_bias and A_log per value head, the
    head-wide output norm whole, the output projection by its columns), else gated attention (q
    and its gate by head, k and v by head or whole where fewer kv heads than tp, o by its columns,
    the q/k norms whole); the MLP dense, or `num_experts` experts with a router and a gated shared
    expert (the gate's one row whole)."""

    def layer(tp: int, i: int) -> list[Param]:
        h, moe = hf["hidden_size"], "num_experts" in hf and hf["model_type"].startswith("qwen3_5_moe")
        if (i + 1) % 4:
            keys = hf["linear_num_key_heads"] * hf["linear_key_head_dim"] // tp
            values, heads = (
                hf["linear_num_value_heads"] * hf["linear_value_head_dim"] // tp,
                hf["linear_num_value_heads"] // tp,
            )
            attn = [(keys, h), (keys, h), (values, h), (values, h), (heads, h), (heads, h), (keys, 1, 4),
                    (keys, 1, 4), (values, 1, 4), (heads,), (heads,), (hf["linear_value_head_dim"],), (h, values)]  # fmt: skip
        else:
            hd, kvh = hf["head_dim"], hf["num_key_value_heads"]
            q, kv = hf["num_attention_heads"] * hd // tp, kvh * hd // (tp if kvh >= tp else 1)
            attn = [(q, h), (kv, h), (kv, h), (h, q), (q, h), (hd,), (hd,)]
        out = [(s, 0, True) for s in [(h,), *attn, (h,)]]  # the norms around the attention
        if not moe:
            f = hf["intermediate_size"] // tp
            return [*out, ((f, h), 0, True), ((f, h), 0, True), ((h, f), 0, True)]
        e, f, fs = (
            hf["num_experts"],
            hf["moe_intermediate_size"] // tp,
            hf["shared_expert_intermediate_size"] // tp,
        )
        gate_up = 2 if tp > 1 else 1
        return [*out, ((e, h), 0, True), ((e, f, h), gate_up, True), ((e, f, h), gate_up, True), ((e, h, f), 1, True),
                ((fs, h), 0, True), ((fs, h), 0, True), ((h, fs), 0, True), ((1, h), 0, True)]  # fmt: skip

    return layer


MOE_MODELS = {
    "DeepSeek V3 671B": PublishedMoE(DEEPSEEK_V3_CONFIG_JSON, 129280, 7168, 61, deepseek_v3_layer),
    "gpt-oss 120B": PublishedMoE(gpt_oss_config_json(36, 128), 201088, 2880, 36, gpt_oss_layer(128)),
    "gpt-oss 20B": PublishedMoE(gpt_oss_config_json(24, 32), 201088, 2880, 24, gpt_oss_layer(32)),
    "GLM-4.5 355B": PublishedMoE(GLM_45_CONFIG_JSON, 151552, 5120, 92, glm_layer(GLM_45_CONFIG_JSON)),
    "GLM-4.5-Air 106B": PublishedMoE(
        GLM_45_AIR_CONFIG_JSON, 151552, 4096, 46, glm_layer(GLM_45_AIR_CONFIG_JSON)
    ),
    "Qwen 3.5 397B-A17B": PublishedMoE(
        QWEN35_397B_CONFIG_JSON, 248320, 4096, 60, qwen35_layer(QWEN35_397B_CONFIG_JSON)
    ),
    "Qwen 3.5 27B": PublishedMoE(
        QWEN35_27B_CONFIG_JSON, 248320, 5120, 64, qwen35_layer(QWEN35_27B_CONFIG_JSON)
    ),
}


FULL_FINE_TUNING = Parallelism(ParallelSpec(), "bf16", 1, attention="auto")  # FSDP2 over dp, 1F1B


def moe_config(name: str) -> ModelConfig:
    """A model of the page's mixtures of experts as mega-convert reads its config.json."""
    from megacore.models.families import config_from_hf

    return config_from_hf(MOE_MODELS[name].config_json)


@functools.cache
def fewest_full_gpus(name: str) -> tuple[int, planner.Candidate]:
    """The fewest 80 GB GPUs (a power of 2) on which a full fine-tuning layout of the page's batch
    fits, and the planner's first pick there."""
    config = moe_config(name)
    for gpus in (1 << i for i in range(11)):
        found = planner.search(config, FULL_FINE_TUNING, gpus, 80 * GiB, B, S, GLOBAL_BATCH, "auto")
        if found[0].fits:
            return gpus, found[0]
    raise AssertionError(f"nothing fits 1024 GPUs: {name}")


def pick_label(pick: planner.Candidate) -> str:
    """A layout as the page writes it: tp, then pp, cp and dp where above 1, ep where above 1."""
    d = pick.dims
    rest = [f"{n} {k}" for n, k in (("pp", d.pp), ("cp", d.cp), ("dp", d.dp)) if k > 1]
    return " × ".join([f"tp {d.tp}", *rest]) + (f" with ep {d.ep}" if d.ep > 1 else "")


def moe_parameters(name: str) -> tuple[int, int]:
    """(every parameter, the trained ones) of a model of MOE_MODELS, from its published shapes."""
    params = MOE_MODELS[name].stage(1, 1, 0)
    return sum(math.prod(s) for s, _, _ in params), sum(math.prod(s) for s, _, trains in params if trains)
