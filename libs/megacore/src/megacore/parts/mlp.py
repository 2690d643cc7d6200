"""The dense MLP part: gate, up and down projections (`config.activation`: a gated SwiGLU or GeGLU,
gpt-oss's clamped SwiGLU, or Falcon's GELU without a gate), `mlp_width` wide. Its tensors, where
tensor parallel splits them (gate and up on their rows, down on its columns, down's bias
replicated), and what it saves for backward."""

from __future__ import annotations

from megacore.config import GATED_ACTIVATIONS, ModelConfig, mlp_width
from megacore.parts.compute import Compute, Shapes, linear

# Tensors ffn wide a gated MLP saves per token (gate and up, then the activation's): SwiGLU and
# GeGLU the activated gate and the product; gpt-oss's clamped SwiGLU the clamped gate, its sigmoid,
# their product, up + 1 and the product (measured with saved_tensors_hooks). GELU: up and gelu(up).
MLP_SAVES = {"swiglu": 4, "geglu_tanh": 4, "clamped_swiglu": 7, "gelu": 2}


def tensors(out: Shapes, config: ModelConfig, at: str, layer: int) -> None:
    """`at`: "layers.<i>.mlp"."""
    hidden, ffn = config.hidden_size, mlp_width(config, layer)
    if config.activation in GATED_ACTIVATIONS:
        linear(out, f"{at}.gate_proj", ffn, hidden, config.mlp_bias)
    linear(out, f"{at}.up_proj", ffn, hidden, config.mlp_bias)
    linear(out, f"{at}.down_proj", hidden, ffn, config.mlp_bias)


def projection_tp_dims(at: str) -> dict[str, int | None]:
    """A dense MLP's projections at layer-relative `at` ("mlp", or a mixture's "mlp.shared_expert")
    -> the dim tp splits (None: replicated)."""
    return {
        f"{at}.gate_proj.weight": 0, f"{at}.gate_proj.bias": 0,
        f"{at}.up_proj.weight": 0, f"{at}.up_proj.bias": 0,
        f"{at}.down_proj.weight": 1, f"{at}.down_proj.bias": None,
    }  # fmt: skip


_TP_DIMS = projection_tp_dims("mlp")


def tp_dims(config: ModelConfig, tp: int) -> dict[str, int | None]:
    return _TP_DIMS


def saves(config: ModelConfig, comp: Compute, tokens: int, layer: int) -> tuple[int, int]:
    """(what the MLP saves, at tp 1 the fused gate/up matmul's concatenated weights), tp-local."""
    f = mlp_width(config, layer) // comp.tp
    gated = config.activation in GATED_ACTIVATIONS
    weights = 2 * f * config.hidden_size * comp.c if comp.fast["projections"] and gated else 0
    return MLP_SAVES[config.activation] * tokens * f * comp.c, weights
