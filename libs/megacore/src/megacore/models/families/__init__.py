"""Model families: the Hugging Face config / tensor-name maps, both directions, one module a family
(`hf_config` and `tensor_map` hold what they share).

Each family module lists the ModelConfig switches its config.json can set (`SWITCHES`), beyond the
fields every family writes (`SHARED_FIELDS`); `check_expressible` refuses a config that sets any
other, on export and on convert. An allow-list, so a switch added to ModelConfig is refused by every
family until one writes it, never dropped silently.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import msgspec

from megacore.config import (
    PART_FIELDS,
    TOKEN_ID_FIELDS,
    ModelConfig,
    RouterLosses,
    config_differences,
    pad_vocab,
    under,
)
from megacore.errors import UserError
from megacore.models.families import (
    deepseek_v3,
    falcon,
    gemma3,
    glm4_moe,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_next,
)
from megacore.models.families.hf_config import max_positions_to_hf
from megacore.models.families.tensor_map import TensorMap

FAMILIES: dict[str, ModuleType] = {
    "llama": llama,
    "mistral": mistral,
    "falcon": falcon,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "gemma3": gemma3,
    "mixtral": mixtral,
    "deepseek_v3": deepseek_v3,
    "gpt_oss": gpt_oss,
    "glm4_moe": glm4_moe,
    "qwen3_5": qwen3_5,
    "qwen3_next": qwen3_next,
}

# The ModelConfig fields every family's config.json writes: the family (its model_type), the sizes,
# the context and RoPE, the norm's eps, the tie and the token ids ...
WRITTEN_BY_ALL = (
    "family",
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "ffn_hidden_size",
    "max_seq_len",
    "norm.eps",
    "rope.theta",
    "rope.scaling",
    "tie_embeddings",
    "bos_id",
    "eos_id",
)
# ... and the one no config.json carries, left out on export by design: the vocab padding (export
# cuts its rows off).
NOT_CARRIED = ("padded_vocab_size",)
# The families whose config.json carries a mixture's load-balancing weight (transformers applies it
# with output_router_logits): a training setting, the run's (`RouterLosses`), which export writes as
# the checkpoint trained with it; transformers' default where it did not train.
ROUTER_AUX_FAMILIES = ("mixtral", "qwen2", "qwen3", "gpt_oss", "qwen3_5", "qwen3_next")
SHARED_FIELDS = (*WRITTEN_BY_ALL, *NOT_CARRIED)


def family_of(config: ModelConfig) -> ModuleType:
    return FAMILIES[config.family]


def hf_attention(model_type: object) -> str:
    """The attn_implementation transformers runs a family's model with here: SDPA, or a family's
    own (`HF_ATTENTION`: gpt-oss's sinks have no SDPA path, only eager)."""
    for fam in FAMILIES.values():
        if model_type in fam.MODEL_TYPES:
            return getattr(fam, "HF_ATTENTION", "sdpa")
    return "sdpa"


def family_for_model_type(model_type: object, where: str) -> ModuleType:
    for fam in FAMILIES.values():
        if model_type in fam.MODEL_TYPES:
            return fam
    known = sorted(t for fam in FAMILIES.values() for t in fam.MODEL_TYPES)
    raise UserError(
        f"$.model_type: {model_type!r} is not a supported architecture (supported: {known})", where
    )


def language_prefix(hf: dict[str, Any]) -> str | None:
    """Where a multimodal checkpoint's language model lies (its tensors' prefix in place of
    `model.`: Qwen 3.5's "model.language_model."), from its family's `MULTIMODAL` table by
    model_type; None for a language model's own config.json."""
    for fam in FAMILIES.values():
        prefix = getattr(fam, "MULTIMODAL", {}).get(hf.get("model_type"))
        if prefix is not None:
            return prefix
    return None


def _text_config(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """A multimodal config.json's language model: its `text_config`, with the embeddings' tie the
    top level states."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise UserError(
            f"$.text_config: a {hf.get('model_type')} config.json holds its language model's there", where
        )
    tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings"))
    return {**text, **({} if tie is None else {"tie_word_embeddings": tie})}


def check_expressible(config: ModelConfig, where: str = "config") -> None:
    """UserError, one line naming the family and the fields, when `config` sets a field its family's
    config.json cannot say: one outside SHARED_FIELDS and the family's SWITCHES that is not at
    ModelConfig's default (a part's settings by path: `mlp.router.bias`). Export calls it so nothing
    is dropped silently, convert so a reader never produces what its writer cannot write back. Value
    constraints on listed switches (Llama's one attention bias switch, ...) are each writer's."""
    fam = family_of(config)
    allowed = {*SHARED_FIELDS, *fam.SWITCHES}
    fields = [f for f in msgspec.structs.fields(config) if f.name not in PART_FIELDS]
    unsaid = [f.name for f in fields if f.name not in allowed and not _at_default(config, f)]
    unsaid += [path for path in _parts_set(config) if under(path, allowed) is None]
    if unsaid:
        raise UserError(f"a {fam.NAME} config.json cannot express {', '.join(unsaid)}", where)


def _at_default(config: ModelConfig, f: msgspec.structs.FieldInfo) -> bool:
    """Whether field `f` holds its default, or what its default resolves to in this config
    (head_dim None: hidden_size / num_heads)."""
    default = _default(f)
    if default is msgspec.NODEFAULT:  # a required field: the sizes, all shared
        return False
    value = getattr(config, f.name)
    if value == default:
        return True
    try:
        return value == getattr(msgspec.structs.replace(config, **{f.name: default}), f.name)
    except ValueError:  # the default does not even make a valid config here
        return False


def _parts_set(config: ModelConfig) -> list[str]:
    """The paths of the parts' settings that are not at their defaults (`_set_paths`)."""
    fields = msgspec.structs.fields(config)
    return [
        p
        for f in fields
        if f.name in PART_FIELDS
        for p in _set_paths(f.name, getattr(config, f.name), _default(f))
    ]


def _default(f: msgspec.structs.FieldInfo) -> object:
    return f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()


def _set_paths(path: str, value: object, default: object) -> list[str]:
    """The paths under `path` of `value`'s settings that `default` does not have: a part of another
    kind than the default's its `type`, the fields a part requires (`mlp.num_experts`), the others
    where they differ from their defaults (a sub-part, `mlp.shared_expert`, field by field)."""
    if not isinstance(value, msgspec.Struct):
        return [] if value == default else [path]
    tagged = type(value).__struct_config__.tag is not None
    out = [f"{path}.type"] if tagged and type(value) is not type(default) else []
    for g in msgspec.structs.fields(value):
        if g.required:
            out.append(f"{path}.{g.name}")
            continue
        out += _set_paths(f"{path}.{g.name}", getattr(value, g.name), _default(g))
    return out


def config_from_hf(
    hf: dict[str, Any] | Any, where: str = "config.json", pad_multiple: int | None = None
) -> ModelConfig:
    """ModelConfig from a HF config: a config.json dict (classic `rope_theta`/`rope_scaling` or
    transformers 5 `rope_parameters`) or a transformers PretrainedConfig. `pad_multiple` sets
    padded_vocab_size (None: no padding)."""
    if not isinstance(hf, dict):
        hf = hf.to_dict()
    fam = family_for_model_type(hf.get("model_type"), where)
    if language_prefix(hf) is not None:  # a multimodal checkpoint: its language model
        hf = _text_config(hf, where)
    cfg = fam.config_from_hf(hf, where)
    check_expressible(cfg, where)  # what the reader made, the family's writer can write back
    if pad_multiple is not None:
        if pad_multiple < 1:
            raise UserError(f"must be at least 1, got {pad_multiple}", "--pad-vocab-multiple")
        cfg = msgspec.structs.replace(cfg, padded_vocab_size=pad_vocab(cfg.vocab_size, pad_multiple))
    return cfg


def training_settings_note(hf: dict[str, Any], config: ModelConfig) -> str | None:
    """The line that says a config.json's load-balancing weight is not carried into the checkpoint:
    a training setting, the run's (None: the config.json sets none, or not for a mixture)."""
    coef = hf.get("router_aux_loss_coef")
    if config.moe is None or config.family not in ROUTER_AUX_FAMILIES or not coef:
        return None
    return (
        f"config.json's router_aux_loss_coef {coef:g} is a training setting, not the model's: a run sets "
        "its own ($.model.router_aux_loss_coef, 0 by default)"
    )


def config_to_hf(
    config: ModelConfig, dtype: str | None = None, router: RouterLosses | None = None
) -> dict[str, Any]:
    """A config.json dict that transformers (4.45+ and 5) loads as the matching *ForCausalLM, with
    the load-balancing weight of the `router` settings a mixture trained with; a UserError when the
    config sets a switch the family's config.json cannot express."""
    check_expressible(config)
    out = family_of(config).config_to_hf(config)
    if router is not None and config.moe is not None and config.family in ROUTER_AUX_FAMILIES:
        out["router_aux_loss_coef"] = router.aux_loss_coef
    if dtype is not None:
        out["torch_dtype"] = dtype
    return out


def differences_from_hf(config: ModelConfig, hf_config: ModelConfig) -> list[str]:
    """The fields in which a checkpoint's config and one read from a config.json differ, but for what
    a config.json does not carry: the token ids (generation settings), `NOT_CARRIED` and, under
    dynamic RoPE scaling, max_seq_len (its max_position_embeddings is then the original context,
    what transformers' dynamic NTK measures growth against: `max_positions_to_hf`)."""
    ignore = (*TOKEN_ID_FIELDS, *NOT_CARRIED)
    s = config.rope.scaling
    if s is not None and s.type == "dynamic" and hf_config.max_seq_len == max_positions_to_hf(config):
        ignore = (*ignore, "max_seq_len")
    return config_differences(config, hf_config, ignore)


__all__ = [
    "FAMILIES",
    "SHARED_FIELDS",
    "TensorMap",
    "check_expressible",
    "config_from_hf",
    "config_to_hf",
    "differences_from_hf",
    "family_for_model_type",
    "family_of",
    "hf_attention",
    "training_settings_note",
]
