"""The families' config maps, both directions: the Qwen and Gemma 3 sliding-window switches read
as transformers reads them (Qwen: one window on all layers or none, the rest refused in one line;
Gemma 3: local and global layers, a RoPE per layer type, published and transformers 5 forms),
defaults as transformers', and each family's allow-list: every ModelConfig switch a family does not
list is refused on export (and on convert), every one it lists is written and read back."""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from transformers import AutoConfig, Gemma3TextConfig

from hf_cases import CASES, case_of
from megacore.config import EXPERT_FAMILIES, PART_FIELDS, ModelConfig, config_fields
from megacore.config_parts import (
    GatedDeltaNetSpec,
    LatentAttentionSpec,
    MoESpec,
    PlusOneRMSNormSpec,
    RopeScaling,
    RopeSpec,
    RouterSpec,
    SequentialBlockSpec,
    SharedExpertSpec,
    StandardAttentionSpec,
)
from megacore.errors import UserError
from megacore.models import FAMILIES, config_from_hf, config_to_hf
from megacore.models.families import SHARED_FIELDS, differences_from_hf

_QWEN = {"vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 64}  # fmt: skip
_SLIDING, _FULL = "sliding_attention", "full_attention"

# switches -> the window every layer attends through (None: full attention)
WINDOWS = {
    "off": ({"use_sliding_window": False, "sliding_window": 8}, None),
    "off, published": ({"use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 28}, None),
    "all layers": ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}, 8),
    # transformers' default max_window_layers (28) leaves a 4-layer model without sliding layers
    "default layers": ({"use_sliding_window": True, "sliding_window": 8}, None),
    "none past the end": ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 4}, None),
    "layer_types all": ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 4,
                         "layer_types": [_SLIDING] * 4}, 8),
    "layer_types none": ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0,
                          "layer_types": [_FULL] * 4}, None),
}  # fmt: skip

REFUSED = {
    "some layers": ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}, "2 of 4 layers"),
    "some layer_types": (
        {"use_sliding_window": True, "sliding_window": 8, "layer_types": [_FULL, _SLIDING, _SLIDING, _SLIDING]},
        "3 of 4 layers",
    ),
    "sliding without a window": (
        {"use_sliding_window": False, "layer_types": [_SLIDING] * 4},
        "sliding layers but no window",
    ),
    "unknown layer type": ({"layer_types": [_FULL, _FULL, _FULL, "chunked_attention"]}, "$.layer_types"),
    "bad window": ({"use_sliding_window": True, "sliding_window": 0, "max_window_layers": 0}, "$.sliding_window"),
}  # fmt: skip


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
@pytest.mark.parametrize("what", list(WINDOWS))
def test_sliding_window_switches(model_type: str, what: str) -> None:
    switches, window = WINDOWS[what]
    cfg = config_from_hf({"model_type": model_type, **_QWEN, **switches})
    assert cfg.sliding_window == window
    # Our config.json, read by transformers' own config class, slides on the same layers ...
    hf = AutoConfig.for_model(**config_to_hf(cfg))
    assert hf.model_type == model_type
    assert hf.layer_types == [_SLIDING if window else _FULL] * 4 and hf.sliding_window == window
    # ... and reads back to the same config.
    assert config_from_hf(hf) == cfg


@pytest.mark.parametrize("what", list(REFUSED))
def test_windows_the_decoder_cannot_express_are_refused(what: str) -> None:
    switches, fragment = REFUSED[what]
    with pytest.raises(UserError) as e:
        config_from_hf({"model_type": "qwen2", **_QWEN, **switches}, where="config.json")
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_kimi_k2_reads_as_the_deepseek_v3_it_is_and_exports_as_one() -> None:
    """Kimi K2's config.json names its own model_type over DeepSeek V3's architecture: read as that
    architecture, written back as deepseek_v3 (what transformers loads); a model_type we have no
    architecture for is one line naming it."""
    cls, kwargs, _ = CASES["deepseek-v3"]
    hf = cls(**kwargs).to_dict()
    kimi = config_from_hf({**hf, "model_type": "kimi_k2"})
    assert kimi == config_from_hf(hf) and config_to_hf(kimi)["model_type"] == "deepseek_v3"
    with pytest.raises(
        UserError, match=r"^config.json: \$.model_type: 'kimi_linear' is not a supported architecture"
    ):
        config_from_hf({**hf, "model_type": "kimi_linear"}, where="config.json")


def test_qwen_defaults_as_transformers() -> None:
    """Keys a config.json leaves out take the transformers class's defaults."""
    bare = {k: v for k, v in _QWEN.items() if k != "num_key_value_heads"}
    q2 = config_from_hf({"model_type": "qwen2", **bare, "num_attention_heads": 32, "hidden_size": 256})
    assert (q2.num_kv_heads, q2.head_dim, q2.norm.eps, q2.max_seq_len) == (32, 8, 1e-6, 32768)
    assert q2.attention == StandardAttentionSpec(bias=True) and not q2.mlp_bias
    q3 = config_from_hf({"model_type": "qwen3", **_QWEN, "num_key_value_heads": None})
    assert (q3.num_kv_heads, q3.head_dim, q3.attention) == (4, 128, StandardAttentionSpec(qk_norm=True))
    biased = config_from_hf({"model_type": "qwen3", **_QWEN, "attention_bias": True})
    assert biased.attention.bias and biased.attention.out_bias


@functools.cache
def _case(name: str) -> ModelConfig:
    cls, kwargs, _ = CASES[name]
    return config_from_hf(cls(**kwargs))


def test_qwen2_head_dim_written_only_when_explicit() -> None:
    """Published Qwen 2 configs carry no head_dim (hidden / heads); one that differs is written,
    and transformers' Qwen2 attention takes it."""
    cfg = _case("qwen2")
    assert "head_dim" not in config_to_hf(cfg)
    wide = msgspec.structs.replace(cfg, head_dim=32)
    assert AutoConfig.for_model(**config_to_hf(wide)).head_dim == 32
    assert config_from_hf(config_to_hf(wide)) == wide


# --- Gemma 3 ----------------------------------------------------------------------------------------

_GEMMA = {"vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 1, "intermediate_size": 64, "head_dim": 16}  # fmt: skip
# Gemma 3 1B's config.json, as published (transformers 4.50's form), shrunk: classic RoPE keys, the
# global layers' scaling in rope_scaling, every 6th layer global by sliding_window_pattern.
_GEMMA_CLASSIC = {**_GEMMA, "num_hidden_layers": 8, "model_type": "gemma3_text", "rope_theta": 1_000_000.0,
                  "rope_local_base_freq": 10_000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                  "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
                  "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
                  "attn_logit_softcapping": None}  # fmt: skip


def test_gemma3_maps_both_ways_through_transformers_config() -> None:
    """The test case's Gemma3TextConfig -> ours -> our config.json -> transformers' own class: the
    same layers slide, the same RoPE per layer type, score scale, head_dim and tying, and back to
    the same config."""
    cls, kwargs, _ = CASES["gemma3"]
    source = cls(**kwargs)
    cfg = config_from_hf(source)
    assert (cfg.family, cfg.norm, cfg.activation) == ("gemma3", PlusOneRMSNormSpec(eps=1e-6), "geglu_tanh")
    assert cfg.attention.qk_norm and cfg.block == SequentialBlockSpec(sandwich_norm=True)
    assert cfg.scale_embeddings and cfg.tie_embeddings
    assert cfg.layer_types == source.layer_types == [_SLIDING, _SLIDING, _FULL, _SLIDING]
    assert (cfg.sliding_window, cfg.head_dim, cfg.attention.scalar) == (8, 32, 24)
    assert cfg.rope == RopeSpec(
        theta=5e5, local_theta=20_000.0, scaling=RopeScaling(type="linear", factor=8.0)
    )
    exported = config_to_hf(cfg)
    hf = AutoConfig.for_model(**exported)
    assert type(hf) is cls and exported["architectures"] == ["Gemma3ForCausalLM"]
    assert hf.layer_types == source.layer_types and hf.sliding_window == source.sliding_window
    assert hf.rope_parameters == source.rope_parameters
    assert (hf.head_dim, hf.query_pre_attn_scalar, hf.tie_word_embeddings) == (32, 24, True)
    assert config_from_hf(hf) == cfg and config_from_hf(exported) == cfg


def test_gemma3_published_config_form_and_defaults() -> None:
    """A published config.json (classic RoPE keys, sliding_window_pattern) reads as transformers
    reads it, and keys a config.json leaves out take Gemma3TextConfig's defaults."""
    cfg = config_from_hf(_GEMMA_CLASSIC)
    assert cfg == config_from_hf(Gemma3TextConfig(**_GEMMA_CLASSIC))
    assert cfg.layer_types == [_SLIDING] * 5 + [_FULL] + [_SLIDING] * 2
    assert (cfg.rope.theta, cfg.rope.local_theta, cfg.rope.scaling.factor) == (1e6, 1e4, 8.0)
    bare = config_from_hf({"model_type": "gemma3_text", **_GEMMA, "num_hidden_layers": 6})
    assert bare == config_from_hf(Gemma3TextConfig(**{**_GEMMA, "num_hidden_layers": 6}))
    assert (bare.sliding_window, bare.attention.scalar, bare.rope.scaling, bare.norm.eps) == (
        4096,
        256,
        None,
        1e-6,
    )
    assert (bare.rope.theta, bare.rope.local_theta, bare.bos_id, bare.eos_id) == (1e6, 1e4, 2, 1)
    assert bare.layer_types == [_SLIDING] * 5 + [_FULL] and bare.tie_embeddings


GEMMA_REFUSED = {
    "attention softcapping": ({"attn_logit_softcapping": 50.0}, "$.attn_logit_softcapping"),
    "final softcapping": ({"final_logit_softcapping": 30.0}, "$.final_logit_softcapping"),
    "unknown layer type": (
        {"layer_types": [_SLIDING, _FULL, _SLIDING, "chunked_attention"]}, "$.layer_types"
    ),
    "layer type count": ({"layer_types": [_SLIDING, _FULL]}, "$.layer_types: expected 4 entries"),
    "sliding without a window": ({"sliding_window": None}, "$.sliding_window: null"),
    "bidirectional": ({"use_bidirectional_attention": True}, "$.use_bidirectional_attention"),
    "activation": ({"hidden_activation": "gelu"}, "$.hidden_activation"),
    "local rope scaling": (
        {"rope_parameters": {_SLIDING: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
        "$.rope_parameters.sliding_attention.rope_type",
    ),
}  # fmt: skip


@pytest.mark.parametrize("what", list(GEMMA_REFUSED))
def test_gemma3_configs_the_decoder_cannot_express_are_refused(what: str) -> None:
    changes, fragment = GEMMA_REFUSED[what]
    with pytest.raises(UserError) as e:
        config_from_hf({"model_type": "gemma3_text", **_GEMMA, **changes}, where="config.json")
    assert fragment in str(e.value) and "\n" not in str(e.value)


# --- what a family's config.json can express: its allow-list ---------------------------------------

FIELDS = {f.name: f for f in msgspec.structs.fields(ModelConfig)}
# The parts' settings by path, and the defaults of those that have one (written out here: a
# required one, `mlp.num_experts`, is set whenever it is there).
PART_DEFAULTS = {
    "norm.type": "rmsnorm", "norm.bias": False, "rope.local_theta": None, "rope.partial_rotary_factor": 1.0, "block.type": "sequential",
    "block.sandwich_norm": False, "block.norms": 1, "attention.bias": False, "attention.out_bias": False,
    "attention.qk_norm": False, "attention.sinks": False, "attention.scalar": None, "attention.output_gate": False,
    "linear_attention.type": None, "linear_attention.conv_kernel": 4,
    "attention.type": "standard", "attention.q_lora_rank": None, "mlp.type": "dense",
    "mlp.router.scoring": "softmax", "mlp.router.renormalize_top_k": True, "mlp.router.bias": False,
    "mlp.router.groups": None, "mlp.router.groups_chosen": None, "mlp.router.scaling": 1.0,
    "mlp.shared_expert.gate": False, "mlp.dense_layers": [], "mlp.dense_ffn_hidden_size": None,
}  # fmt: skip
PART_REQUIRED = ("attention.kv_lora_rank", "attention.qk_rope_head_dim", "attention.v_head_dim",
                 "mlp.num_experts", "mlp.experts_per_token", "mlp.shared_expert.size",
                 *(f"linear_attention.{f}" for f in ("key_heads", "value_heads", "key_head_dim", "value_head_dim")))  # fmt: skip
# The switches: every ModelConfig field but those every family writes (or none carries), a part's
# settings by path.
SWITCHES = [
    *(name for name in FIELDS if name not in (*SHARED_FIELDS, *PART_FIELDS)),
    *PART_DEFAULTS,
    *PART_REQUIRED,
]


def _moe(**changes: Any) -> dict[str, Any]:
    return {"mlp": MoESpec(num_experts=4, experts_per_token=2, **changes)}


def _latent(c: ModelConfig, **changes: Any) -> dict[str, Any]:
    """Latent attention on a base (standard attention's settings gone with it): one k/v head per q
    head."""
    latent = LatentAttentionSpec(kv_lora_rank=16, qk_rope_head_dim=4, v_head_dim=8, **changes)
    return {"attention": latent, "num_kv_heads": c.num_heads, "head_dim": 12}


def _linear(c: ModelConfig, **changes: Any) -> dict[str, Any]:
    """Gated DeltaNet in the first layer of a base."""
    spec = GatedDeltaNetSpec(key_heads=2, value_heads=4, key_head_dim=8, value_head_dim=8, **changes)
    return {"linear_attention": spec, "layer_types": ["linear_attention"] + [_FULL] * (c.num_layers - 1)}


def _with(cfg: ModelConfig, changes: dict[str, Any]) -> ModelConfig:
    """`cfg` with settings replaced by name or by path (`attention.bias`), a part's kind replaced
    whole (`{"block": {"type": "parallel"}}`); ValueError when that is no valid config."""
    raw = msgspec.to_builtins(cfg)
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        target = raw
        for p in parents:
            target = target[p]
        target[leaf] = msgspec.to_builtins(value)
    return msgspec.convert(raw, ModelConfig)


# Each switch at a value other than its default, with what that value needs to make a valid
# ModelConfig on a family's base (changes by name or path, `_with`). A switch added to ModelConfig needs an entry here; it is then
# refused by every family whose SWITCHES do not list it (and `check_expressible` refuses it
# whether or not this table has it).
NON_DEFAULT: dict[str, Callable[[ModelConfig], dict[str, Any]]] = {
    "norm.type": lambda c: {"norm": {"type": "layernorm"}},
    "norm.bias": lambda c: {"norm": {"type": "layernorm", "bias": True}},
    "activation": lambda c: {"activation": "gelu"},
    "head_dim": lambda c: {"head_dim": 2 * c.hidden_size // c.num_heads},
    "sliding_window": lambda c: {"sliding_window": 8},
    "layer_types": lambda c: {"sliding_window": 8, "layer_types": [_SLIDING] + [_FULL] * (c.num_layers - 1)},
    "rope.local_theta": lambda c: {"rope.local_theta": 20_000.0},
    "rope.partial_rotary_factor": lambda c: {"rope.partial_rotary_factor": 0.5},
    "attention.scalar": lambda c: {"attention.scalar": 24.0},
    "block.type": lambda c: {"block": {"type": "parallel"}},
    "block.norms": lambda c: {"block": {"type": "parallel", "norms": 2}},
    "attention.bias": lambda c: {"attention.bias": True},
    "attention.out_bias": lambda c: {"attention.out_bias": True},
    "mlp_bias": lambda c: {"mlp_bias": True},
    "attention.qk_norm": lambda c: {"attention.qk_norm": True},
    "block.sandwich_norm": lambda c: {"block": {"type": "sequential", "sandwich_norm": True}},
    "scale_embeddings": lambda c: {"scale_embeddings": True},
    "mlp.type": lambda c: _moe(),
    "mlp.num_experts": lambda c: _moe(),
    "mlp.experts_per_token": lambda c: _moe(),
    "mlp.router.renormalize_top_k": lambda c: _moe(router=RouterSpec(renormalize_top_k=False)),
    "mlp.dense_layers": lambda c: _moe(dense_layers=[0], dense_ffn_hidden_size=2 * c.ffn_hidden_size),
    "mlp.dense_ffn_hidden_size": lambda c: _moe(dense_layers=[0], dense_ffn_hidden_size=2 * c.ffn_hidden_size),
    "mlp.shared_expert.size": lambda c: _moe(shared_expert=SharedExpertSpec(size=24, gate=True)),
    "mlp.shared_expert.gate": lambda c: _moe(shared_expert=SharedExpertSpec(size=24, gate=True)),
    "mlp.router.scoring": lambda c: _moe(router=RouterSpec(scoring="sigmoid")),
    "mlp.router.bias": lambda c: _moe(router=RouterSpec(bias=True)),
    "mlp.router.groups": lambda c: _moe(router=RouterSpec(groups=2, groups_chosen=1)),
    "mlp.router.groups_chosen": lambda c: _moe(router=RouterSpec(groups=2, groups_chosen=1)),
    "mlp.router.scaling": lambda c: _moe(router=RouterSpec(scaling=2.5)),
    "attention.type": lambda c: _latent(c),
    "attention.q_lora_rank": lambda c: _latent(c, q_lora_rank=16),
    "attention.kv_lora_rank": lambda c: _latent(c),
    "attention.qk_rope_head_dim": lambda c: _latent(c),
    "attention.v_head_dim": lambda c: _latent(c),
    "attention.sinks": lambda c: {"attention.sinks": True},
    "attention.output_gate": lambda c: {"attention.output_gate": True},
    **{f"linear_attention.{f}": lambda c: _linear(c) for f in ("type", "key_heads", "value_heads", "key_head_dim", "value_head_dim")},
    "linear_attention.conv_kernel": lambda c: _linear(c, conv_kernel=2),
    "swiglu_alpha": lambda c: {"activation": "clamped_swiglu", "swiglu_alpha": 1.5},
    "swiglu_limit": lambda c: {"activation": "clamped_swiglu", "swiglu_limit": 3.0},
}  # fmt: skip
# Configs ModelConfig itself refuses, so none exists to export: experts outside Mixtral and Qwen 2/3,
# and Mixtral's experts (always there) with an MLP other than SwiGLU without biases.
_EXPERT_SWITCHES = tuple(s for s in SWITCHES if s.startswith("mlp."))
_LATENT_SWITCHES = tuple(f"attention.{f.name}" for f in msgspec.structs.fields(LatentAttentionSpec))
_LATENT_SWITCHES = ("attention.type", *_LATENT_SWITCHES)
_STANDARD_SWITCHES = tuple(f"attention.{f.name}" for f in msgspec.structs.fields(StandardAttentionSpec))
UNBUILDABLE = {(f, s) for f in FAMILIES if f not in EXPERT_FAMILIES for s in _EXPERT_SWITCHES} | {
    ("mixtral", "activation"),
    # DeepSeek V3's experts (SwiGLU) and latent attention (none of standard attention's settings,
    # nor a partial rotary factor).
    *(("deepseek_v3", s) for s in ("activation", *_STANDARD_SWITCHES, "rope.partial_rotary_factor")),
    # GLM-4.5's experts (SwiGLU) and its partial rotary embedding (standard attention's).
    ("glm4_moe", "activation"),
    *(("glm4_moe", s) for s in _LATENT_SWITCHES),
    # Qwen 3.5's partial rotary embedding too; Qwen3-Next's and its experts (SwiGLU).
    *(("qwen3_5", s) for s in _LATENT_SWITCHES),
    *(("qwen3_next", s) for s in _LATENT_SWITCHES),
    ("qwen3_next", "activation"),
}
# Samples beyond hf_cases' and NON_DEFAULT's that set a family's switches as its writer takes them.
VARIANTS: dict[str, list[dict[str, Any]]] = {
    "qwen3": [{"attention.bias": True, "attention.out_bias": True}],
    "gemma3": [{"attention.bias": True, "attention.out_bias": True}],
    "gpt_oss": [{"swiglu_alpha": 1.5}],
    "glm4_moe": [{"mlp.router.renormalize_top_k": False}],
    "qwen3_next": [{"mlp.router.renormalize_top_k": False}],
}
OFF_LIST = [(f, s) for f in FAMILIES for s in SWITCHES if s not in FAMILIES[f].SWITCHES]
ON_LIST = [(f, s) for f in FAMILIES for s in FAMILIES[f].SWITCHES]


def _base(family: str) -> ModelConfig:
    """The family's first config in hf_cases, the base the allow-list tests vary."""
    return _case(case_of(family))


def _vary(family: str, switch: str) -> ModelConfig:
    assert switch in NON_DEFAULT, f"give the new switch {switch} a non-default value in NON_DEFAULT"
    base = _base(family)
    return _with(base, NON_DEFAULT[switch](base))


def _non_default(cfg: ModelConfig, name: str) -> bool:
    if name in (*PART_DEFAULTS, *PART_REQUIRED):
        value = config_fields(cfg).get(name, _ABSENT)
        return value is not _ABSENT and value != PART_DEFAULTS.get(name, _ABSENT)
    default = cfg.hidden_size // cfg.num_heads if name == "head_dim" else FIELDS[name].default
    return getattr(cfg, name) != default


_ABSENT = object()


@pytest.mark.parametrize(("family", "switch"), [p for p in OFF_LIST if p not in UNBUILDABLE])
def test_export_refuses_every_switch_off_the_family_list(family: str, switch: str) -> None:
    """Every ModelConfig field but the shared ones, set on a family that does not list it, is
    refused on export in one line naming the family and the field: nothing is dropped silently."""
    cfg = _vary(family, switch)
    assert _non_default(cfg, switch)
    with pytest.raises(UserError) as e:
        config_to_hf(cfg)
    message = str(e.value)
    said = re.fullmatch(rf"config: a {FAMILIES[family].NAME} config\.json cannot express (.+)", message)
    assert said and switch in said[1].split(", "), message


@pytest.mark.parametrize(("family", "switch"), sorted(UNBUILDABLE))
def test_unbuildable_pairs_are_no_configs(family: str, switch: str) -> None:
    """The pairs the test above leaves out: ModelConfig itself refuses them."""
    with pytest.raises(ValueError):
        _vary(family, switch)


def _samples(family: str, switch: str) -> list[ModelConfig]:
    """The family's hf_cases, its VARIANTS and its base with `switch` set, as far as valid."""
    cases = [_case(name) for name in CASES]
    out = [c for c in cases if c.family == family]
    base = _base(family)
    for changes in [*VARIANTS.get(family, []), NON_DEFAULT[switch](base)]:
        with contextlib.suppress(ValueError):
            out.append(_with(base, changes))
    return out


@pytest.mark.parametrize(("family", "switch"), ON_LIST)
def test_every_switch_on_a_family_list_is_written_and_read_back(family: str, switch: str) -> None:
    """A switch a family lists is one its config.json carries: some config of the family sets it,
    its writer takes that config and its reader gives the switch back. A field listed that the
    writer does not write (or refuses in every form) fails here."""
    exported = []
    for cfg in _samples(family, switch):
        if _non_default(cfg, switch):
            with contextlib.suppress(UserError):
                exported.append((cfg, config_to_hf(cfg)))
    assert exported, f"no {family} config with {switch} set exports: add one to VARIANTS"
    for cfg, hf in exported:
        assert config_fields(config_from_hf(hf))[switch] == config_fields(cfg)[switch]


@pytest.mark.parametrize("case", list(CASES))
def test_every_case_reads_back_from_its_export(case: str) -> None:
    cfg = _case(case)
    assert differences_from_hf(cfg, config_from_hf(config_to_hf(cfg))) == []


class _WithNewSwitch(ModelConfig):
    """ModelConfig as it would be with a switch added that no family writes yet."""

    new_switch: bool = False


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_new_switch_is_refused_by_every_family(family: str) -> None:
    base = _base(family)
    fields = msgspec.structs.asdict(base)
    assert config_to_hf(_WithNewSwitch(**fields)) == config_to_hf(base)
    with pytest.raises(
        UserError, match=rf"a {FAMILIES[family].NAME} config\.json cannot express new_switch$"
    ):
        config_to_hf(_WithNewSwitch(**fields, new_switch=True))


def test_convert_refuses_what_the_family_writer_cannot_write_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check on what a reader produced: a reader setting a switch off its family's list
    (here: Llama's list emptied) is refused, not converted into a checkpoint that cannot go back."""
    cls, kwargs, _ = CASES["llama-bias-tied"]
    monkeypatch.setattr(FAMILIES["llama"], "SWITCHES", ())
    with pytest.raises(
        UserError, match="a Llama config.json cannot express mlp_bias, attention.bias, attention.out_bias"
    ):
        config_from_hf(cls(**kwargs))


def test_mistral_and_mixtral_read_no_bias_keys() -> None:
    """MistralConfig and MixtralConfig have no bias switches: transformers builds their projections
    without biases whatever a config.json says, and so do we."""
    for case in ("mistral-window", "mixtral"):
        cls, kwargs, _ = CASES[case]
        hf = {**cls(**kwargs).to_dict(), "attention_bias": True, "mlp_bias": True}
        cfg = config_from_hf(hf)
        assert not (cfg.attention.bias or cfg.attention.out_bias or cfg.mlp_bias)
        assert "attention_bias" not in config_to_hf(cfg) and "mlp_bias" not in config_to_hf(cfg)


@pytest.mark.parametrize(
    ("case", "changes", "fragment"),
    [
        ("llama", {"attention.bias": True}, "Llama has one attention bias switch"),
        ("falcon-7b", {"mlp_bias": True}, "Falcon has one `bias` switch"),
        ("falcon-7b", {"norm": {"type": "rmsnorm"}}, "Falcon needs layernorm with bias and a gelu MLP"),
        ("falcon-7b", {"activation": "swiglu"}, "Falcon needs layernorm with bias and a gelu MLP"),
        ("qwen2", {"attention.bias": False}, "Qwen 2 always has biases on q, k and v"),
        ("qwen3", {"attention.qk_norm": False}, "Qwen 3 has q/k norms and one attention bias switch"),
        ("qwen3", {"attention.out_bias": True}, "Qwen 3 has q/k norms and one attention bias switch"),
        ("gemma3", {"norm": {"type": "rmsnorm"}}, "Gemma 3 config.json always has norm.type 'rmsnorm_plus1'"),
        ("gemma3", {"activation": "swiglu"}, "always has activation 'geglu_tanh'"),
        ("gemma3", {"block.sandwich_norm": False, "scale_embeddings": False, "attention.qk_norm": False},
         "always has attention.qk_norm True, block.sandwich_norm True, scale_embeddings True; this config differs"),
        ("gemma3", {"attention.out_bias": True}, "Gemma 3 has one attention bias switch"),
        ("gemma3", {"rope.local_theta": None}, "rope.local_theta"),
        ("gpt-oss", {"attention.sinks": False}, "gpt-oss is a mixture of experts with attention sinks"),
        ("gpt-oss", {"activation": "swiglu", "swiglu_limit": 7.0}, "gpt-oss is a mixture of experts with attention sinks"),
    ],
)  # fmt: skip
def test_export_refuses_values_the_family_cannot_take(case: str, changes: dict, fragment: str) -> None:
    """Switches on a family's list whose values its config.json still fixes: each writer's checks."""
    cfg = _with(_case(case), changes)
    with pytest.raises(UserError, match=re.escape(fragment)) as e:
        config_to_hf(cfg)
    assert "\n" not in str(e.value)
