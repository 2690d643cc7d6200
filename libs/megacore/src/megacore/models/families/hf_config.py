"""Reading a HF config.json with clear errors (`HFConfig`, RoPE settings in both config forms
included) and writing the keys the families spell alike (`llama_style_to_hf`, `rope_to_hf`,
`max_positions_to_hf`); `build_config` turns what a family read into a checked ModelConfig."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from megacore.config import ModelConfig
from megacore.config_parts import ROPE_FIELDS, RopeScaling
from megacore.errors import UserError


def read_config_json(path: Path, where: str = "") -> dict[str, Any]:
    """The JSON object of a Hugging Face `config.json` (`path`: the file, or a model directory
    holding one); a UserError naming it (after `where`, when given) otherwise."""
    file = path / "config.json" if path.is_dir() else path
    at = f"{where}: {file}" if where else str(file)
    if not file.is_file():
        missing = "no config.json: not a Hugging Face model directory" if path.is_dir() else "no such file"
        raise UserError(missing, f"{where}: {path}" if where else str(path))
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as e:  # invalid JSON or text
        raise UserError(f"not valid JSON ({e})", at) from None
    if not isinstance(data, dict):
        raise UserError("expected a JSON object", at)
    return data


_MISSING = object()


class HFConfig:
    """Typed access to a config.json dict; every problem is a UserError naming the field."""

    def __init__(self, data: dict[str, Any], where: str, aliases: dict[str, str] | None = None) -> None:
        self.data = dict(data)
        self.where = where
        for new, old in (aliases or {}).items():  # old key names of early checkpoints
            if new not in self.data and old in self.data:
                self.data[new] = self.data[old]

    def _get(self, key: str, default: Any) -> Any:
        value = self.data.get(key, default)
        if value is _MISSING:
            raise UserError(f"$.{key}: missing required field", self.where)
        return value

    def int(self, key: str, default: Any = _MISSING, minimum: int = 1) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise UserError(f"$.{key}: expected an integer >= {minimum}, got {value!r}", self.where)
        return value

    def opt_int(self, key: str) -> int | None:
        value = self.data.get(key)
        if isinstance(value, list):  # e.g. Llama 3.1 lists several eos ids; the first is the primary one
            value = value[0] if value else None
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"$.{key}: expected an integer, got {value!r}", self.where)
        return value

    def float(self, key: str, default: Any = _MISSING) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise UserError(f"$.{key}: expected a positive number, got {value!r}", self.where)
        return float(value)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise UserError(f"$.{key}: expected true or false, got {value!r}", self.where)
        return value

    def str(self, key: str, default: Any = _MISSING) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise UserError(f"$.{key}: expected a string, got {value!r}", self.where)
        return value

    def rope(
        self, key: str = "rope_parameters", trained: int | None = None, partial: bool = False
    ) -> tuple[float, RopeScaling | None]:
        """(rope_theta, scaling) from transformers 5's `rope_parameters` or the classic top-level
        `rope_theta` + `rope_scaling` that published checkpoints carry. `key`: where the
        rope_parameters object is (Gemma 3 keeps one per layer type: "rope_parameters.full_attention").
        `trained`: the family's max_position_embeddings (None: the key's value, else 2048), what
        transformers takes for an original context the config does not give. A partial rotary factor
        other than 1 is refused unless the family reads it (`partial`: `partial_rotary`)."""
        params = self.data.get(key)
        if params is not None and not isinstance(params, dict):
            raise UserError(f"$.{key}: expected an object, got {params!r}", self.where)
        if not partial and self.partial_rotary(key, 1.0) != 1.0:
            raise UserError(
                "$.partial_rotary_factor: a partial rotary embedding is not supported in this family "
                "(every dim of a head rotates)",
                self.where,
            )
        if params:
            theta = params.get("rope_theta", self.data.get("rope_theta", 10000.0))
            scaling, at = params, key
        else:
            theta = self.data.get("rope_theta", 10000.0)
            scaling, at = self.data.get("rope_scaling"), "rope_scaling"
        if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
            raise UserError(f"$.rope_theta: expected a positive number, got {theta!r}", self.where)
        if scaling is None:
            return float(theta), None
        if not isinstance(scaling, dict):
            raise UserError(f"$.{at}: expected an object, got {scaling!r}", self.where)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            return float(theta), None
        if kind not in ROPE_FIELDS:
            raise UserError(
                f"$.{at}.rope_type: {kind!r} is not supported ({', '.join(ROPE_FIELDS)})", self.where
            )
        if trained is None:
            trained = self.int("max_position_embeddings", 2048)
        return float(theta), self._scaling(kind, HFConfig(scaling, self.where), at, trained)

    def layer_types(self, num_layers: int, other: str, interval_key: str, interval: int) -> list[str]:
        """Each layer's attention, as transformers' configs read it: `layer_types`, else every
        `interval_key`-th layer (default `interval`) "full_attention" and the others `other`
        (Gemma 3's "sliding_attention", Qwen 3.5's "linear_attention"). A list of the wrong length,
        or a kind not of these two, is a UserError naming it."""
        kinds = (other, "full_attention")
        types = self.data.get("layer_types")
        if types is None:
            every = self.int(interval_key, interval)
            return [kinds[(i + 1) % every == 0] for i in range(num_layers)]
        if not (isinstance(types, list) and len(types) == num_layers):
            raise UserError(f"$.layer_types: expected {num_layers} entries, one per layer", self.where)
        for i, kind in enumerate(types):
            if kind not in kinds:
                raise UserError(
                    f"$.layer_types[{i}]: {kind!r} is not a layer type here ({', '.join(kinds)})", self.where
                )
        return list(types)

    def partial_rotary(self, key: str = "rope_parameters", default: float = 1.0) -> float:
        """The share of each head's dims RoPE rotates: `partial_rotary_factor` in `key`'s object or
        at the top level (transformers 5 moves it into rope_parameters), else `default`."""
        params = self.data.get(key)
        value = params.get("partial_rotary_factor") if isinstance(params, dict) else None
        if value is None:
            value = self.data.get("partial_rotary_factor")
        if value is None:
            return default
        value = HFConfig({"partial_rotary_factor": value}, self.where).float("partial_rotary_factor")
        if value > 1:
            raise UserError(
                f"$.partial_rotary_factor: expected a number in (0, 1], got {value:g}", self.where
            )
        return value

    def _scaling(self, kind: str, sub: HFConfig, at: str, trained: int) -> RopeScaling:
        """The scaling object `sub` (at `$.{at}`) of type `kind`, read as transformers reads it."""
        factor = sub.float("factor")
        if factor < 1:  # (RopeScaling refuses it too: this names the config.json's field)
            raise UserError(
                f"$.{at}.factor: {factor:g} is below 1; a rope scaling stretches the context", self.where
            )
        if kind == "linear":
            return RopeScaling(type="linear", factor=factor)
        if kind == "dynamic":  # transformers' dynamic NTK measures growth against max_position_embeddings
            return RopeScaling(type="dynamic", factor=factor, original_max_position_embeddings=trained)
        # A top-level original_max_position_embeddings wins (transformers' standardize_rope_params),
        # then the scaling's own, then max_position_embeddings.
        original = self.int(
            "original_max_position_embeddings", sub.int("original_max_position_embeddings", trained)
        )
        if kind == "llama3":
            return RopeScaling(
                type="llama3",
                factor=factor,
                original_max_position_embeddings=original,
                low_freq_factor=sub.float("low_freq_factor"),
                high_freq_factor=sub.float("high_freq_factor"),
            )
        # (partial_rotary_factor: `rope` read it)
        known = {"rope_type", "type", "rope_theta", "factor", "partial_rotary_factor", *_YARN_KEYS}
        extra = sorted(set(sub.data) - known)
        if extra:
            raise UserError(f"$.{at}.{extra[0]}: not supported in yarn rope scaling", self.where)
        values: dict[str, Any] = {}
        for k in _YARN_KEYS[1:]:  # the optional ones: None takes transformers' default
            if sub.data.get(k) is not None:
                values[k] = sub.bool(k) if k == "truncate" else sub.float(k)
        return RopeScaling(type="yarn", factor=factor, original_max_position_embeddings=original, **values)


# The keys of a yarn scaling object besides its type, theta and factor, as RopeScaling names them.
_YARN_KEYS = ROPE_FIELDS["yarn"]


def llama_style_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The config.json keys the Llama lineage (Llama, Mistral, Qwen, Gemma) spells alike: sizes,
    positions, the RMSNorm eps, RoPE, the tie and the token ids."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "max_position_embeddings": max_positions_to_hf(config),
        "rms_norm_eps": config.norm.eps,
        **rope_to_hf(config),
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": config.bos_id,
        "eos_token_id": config.eos_id,
    }


def max_positions_to_hf(config: ModelConfig) -> int:
    """config.json's max_position_embeddings: max_seq_len, but under dynamic scaling the original
    context, which transformers' dynamic NTK measures a sequence's growth against."""
    s = config.rope.scaling
    if s is not None and s.type == "dynamic" and s.original_max_position_embeddings is not None:
        return s.original_max_position_embeddings
    return config.max_seq_len


def rope_to_hf(config: ModelConfig) -> dict[str, Any]:
    """Classic form (top-level rope_theta + rope_scaling): what transformers 4.45+ and 5 both load.
    Every field the scaling type reads is written, those left None (transformers' defaults) not."""
    s = config.rope.scaling
    scaling = None
    if s is not None:
        scaling = {"rope_type": s.type, "factor": s.factor}
        if s.type in ("llama3", "yarn"):
            scaling.update({k: getattr(s, k) for k in ROPE_FIELDS[s.type] if getattr(s, k) is not None})
    return {"rope_theta": config.rope.theta, "rope_scaling": scaling}


def build_config(where: str, **fields: Any) -> ModelConfig:
    """A ModelConfig from config.json values (its parts, `mlp` and `attention`, as their manifest
    objects); one that is inconsistent (ModelConfig checks itself) is a UserError naming the file."""
    try:
        return msgspec.convert(fields, ModelConfig)
    except ValueError as e:
        raise UserError(str(e), where) from None
