"""Mixtral: Mistral's decoder whose MLPs are sparse mixtures of SwiGLU experts (`models/moe.py`).

HF layout (MixtralForCausalLM, as the Hub's checkpoints and transformers' save_pretrained write
it): Llama's names, and per layer `block_sparse_moe.gate` (the router) and
`block_sparse_moe.experts.<j>.{w1,w3,w2}` (gate, up, down), stacked per projection in ours
(`llama.moe_experts`). transformers 5 fuses w1/w3 into `mlp.experts.gate_up_proj` in memory
and writes the per-expert names back when saving. The router's load-balancing coefficient
(`router_aux_loss_coef`) is a training setting, the run's (`config.RouterLosses`); the router jitter
noise transformers can add in training is not implemented, and a config that sets it is refused.
"""

from __future__ import annotations

from typing import Any

from megacore.config import ModelConfig
from megacore.errors import UserError
from megacore.models.families import llama, mistral
from megacore.models.families.hf_config import HFConfig, build_config
from megacore.models.families.tensor_map import TensorMap

MODEL_TYPES = ("mixtral",)
ARCHITECTURE = "MixtralForCausalLM"
NAME = "Mixtral"
# The ModelConfig fields besides `families.SHARED_FIELDS` a Mixtral config.json can set to other
# than their defaults (`families.check_expressible` refuses the rest). The router always
# renormalises its top-k (`mlp.router.renormalize_top_k` true).
SWITCHES = ("head_dim", "sliding_window", "mlp.type", "mlp.num_experts", "mlp.experts_per_token")


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    c = HFConfig(hf, where)
    jitter = c.data.get("router_jitter_noise") or 0.0
    if jitter:
        raise UserError(f"$.router_jitter_noise: {jitter!r} is not supported (0)", where)
    return build_config(
        where,
        family="mixtral",
        **llama.lineage_fields(c),
        sliding_window=mistral.sliding_window(c, None),
        mlp={
            "type": "moe",
            "num_experts": c.int("num_local_experts", 8),
            "experts_per_token": c.int("num_experts_per_tok", 2),
        },
    )


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    return {
        **llama.lineage_to_hf(config, ARCHITECTURE, "mixtral"),
        "sliding_window": config.sliding_window,
        "num_local_experts": config.moe.num_experts,
        "num_experts_per_tok": config.moe.experts_per_token,
    }


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    return llama.tensor_maps(config)
