"""A decoder made of parts (torch-free): every layer is a block (`block`: its norms' arrangement)
of an attention part (`attention`: standard, grouped-query; `latent`: DeepSeek's multi-head latent
attention; `linear`: Gated DeltaNet's linear attention, in the layers `layer_types` names) and an
MLP part (`mlp`: dense; `moe`: a mixture of experts with its router), whose norms are the `norm`
part. Which parts a layer is made of is read off its `ModelConfig`
(`layer_parts`), per layer where layers differ (a mixture's dense layers).

Each part's module holds, next to each other, what it adds:
- `tensors(out, config, at[, layer])`: its rows of the naming contract, in state-dict order
  (`model_tensors` assembles them);
- `tp_dims(config, tp)`: where tensor parallel splits each of its tensors, layer-relative names to
  a dim or None (replicated), the table `parallel.layout.place` reads;
- its planner terms, `saves(...)`: the bytes its ops keep for backward (`planner.activations` adds
  them up; `parts.compute.Compute` is what they read of a rank's step).
A new kind of layer is one new part module here and its torch module in `megacore.models`
(docs/adding-a-family.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

from megacore.config import LORA_A, LORA_B, ModelConfig, linear_layer, sparse_layer
from megacore.parts import attention, block, latent, linear, mlp, moe, norm
from megacore.parts.compute import Shapes


def attention_part(config: ModelConfig, layer: int) -> ModuleType:
    """Layer `layer`'s attention part: linear where `layer_types` says so (`config.linear_attention`),
    else latent or standard (`config.attention`)."""
    if linear_layer(config, layer):
        return linear
    return latent if config.latent is not None else attention


def mlp_part(config: ModelConfig, layer: int) -> ModuleType:
    """Layer `layer`'s MLP part: a mixture of experts, or dense (a mixture's dense layers too)."""
    return moe if sparse_layer(config, layer) else mlp


def layer_parts(config: ModelConfig, layer: int) -> tuple[ModuleType, ModuleType, ModuleType]:
    """(block, attention, MLP) part modules of layer `layer`."""
    return block, attention_part(config, layer), mlp_part(config, layer)


def tp_dim(config: ModelConfig, layer: int, name: str, tp: int) -> int | None:
    """The dim tp splits layer `layer`'s tensor `name` (layer-relative, "attn.q_proj.weight") on
    (None: replicated), from its parts' tables; KeyError for a name none of them has."""
    for part in layer_parts(config, layer):
        dims = part.tp_dims(config, tp)
        if name in dims:
            return dims[name]
    raise KeyError(name)


def model_tensors(
    config: ModelConfig, layers: Sequence[int] | None = None, embed: bool = True, head: bool = True
) -> dict[str, tuple[int, ...]]:
    """The model naming contract: names and global shapes of the model's tensors, in the Decoder's
    state-dict order (tested), shared by the parallel layout, the converters, mega-shard and the
    checkpoints: "embed.weight", each layer's parts' ("layers.<i>.attn_norm.weight",
    "layers.<i>.attn.{q,k,v,o}_proj.{weight,bias}", ..., "layers.<i>.mlp.{gate,up,down}_proj.
    weight" or a mixture's "layers.<i>.mlp.router.weight" and stacked "layers.<i>.mlp.experts.
    {gate,up,down}_proj.weight"; each part's module lists its own), "norm.weight",
    "lm_head.weight". `layers`, `embed` and `head` select a pipeline stage's part.
    Tied embeddings: the model has no "lm_head.weight" (logits use "embed.weight"), but a pipeline
    stage with the head and not the embedding holds one, a copy of "embed.weight" kept equal to it
    by the engine (Megatron's shared embedding), never written to a checkpoint."""
    out: Shapes = {}
    if embed:
        out["embed.weight"] = (config.padded_vocab_size, config.hidden_size)
    for i in range(config.num_layers) if layers is None else layers:
        _, attn, ffn = layer_parts(config, i)
        block.tensors(out, config, i, attn, ffn)
    if head:
        norm.tensors(out, config, "norm")
        if not (config.tie_embeddings and embed):
            out["lm_head.weight"] = (config.padded_vocab_size, config.hidden_size)
    return out


def adapter_tensors(config: ModelConfig, modules: Sequence[str], rank: int) -> dict[str, tuple[int, ...]]:
    """A LoRA adapter's tensors (PEFT's shapes) on the linear `modules` (contract names, as
    "layers.3.attn.q_proj"): `<module>.lora_A.weight` [rank, in] and `<module>.lora_B.weight`
    [out, rank], in `modules`' order."""
    shapes = model_tensors(config)
    out: Shapes = {}
    for module in modules:
        rows, cols = shapes[f"{module}.weight"]
        out[f"{module}.{LORA_A}"] = (rank, cols)
        out[f"{module}.{LORA_B}"] = (rows, rank)
    return out
