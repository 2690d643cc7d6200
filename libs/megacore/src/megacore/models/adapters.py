"""LoRA adapters' rules, without torch: which modules a family's adapters can target (by the
Hugging Face module names PEFT's `target_modules` uses), the resolved settings of a run's `lora`
section (`LoRA`), the scale, and the names of the adapter's tensors in PEFT's files.

An adapter on a linear `W` (our contract name `layers.3.attn.q_proj`) adds scale · B A x to its
output: A is `<module>.lora_A.weight` [rank, in], B `<module>.lora_B.weight` [out, rank]
(`megacore.parts.adapter_tensors`), as PEFT's LoRA computes it. The targetable modules come from
the family's name map (`tensor_maps`): every layer linear that is one Hugging Face tensor under
another name; a fused one (Falcon's query_key_value) or a mixture of experts' experts are not.
`megacore.models.lora` attaches them to a Decoder.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from megacore.artifacts.manifest import Adapter
from megacore.config import LoRA, ModelConfig
from megacore.errors import UserError
from megacore.models.families import family_of
from megacore.parts import model_tensors

PEFT_PREFIX = "base_model.model."  # PEFT's prefix of the wrapped model's module names


def _layer_maps(config: ModelConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    """(Hugging Face module, our module, our weight's shape) of every layer linear that is one HF
    tensor renamed."""
    shapes = model_tensors(config)
    out = []
    for m in family_of(config).tensor_maps(config):
        if len(m.hf) != 1 or len(m.ours) != 1 or not m.ours[0].startswith("layers."):
            continue
        hf, ours = m.hf[0], m.ours[0]
        if hf.endswith(".weight") and ours.endswith(".weight") and len(shapes[ours]) == 2:
            out.append((hf.removesuffix(".weight"), ours.removesuffix(".weight"), shapes[ours]))
    return out


def _short(module: str) -> str:
    return module.rpartition(".")[2]


def targetable(config: ModelConfig) -> dict[str, list[str]]:
    """Hugging Face module name -> our modules it names (every layer's), for this config."""
    out: dict[str, list[str]] = {}
    for hf, ours, _ in _layer_maps(config):
        out.setdefault(_short(hf), []).append(ours)
    return out


def _expert_names(config: ModelConfig) -> set[str]:
    """The Hugging Face module names of a mixture of experts' experts (Mixtral's w1/w2/w3)."""
    names = set()
    for m in family_of(config).tensor_maps(config):
        if len(m.hf) > 1 and len(m.ours) == 1 and ".mlp.experts." in m.ours[0]:
            names.update(_short(h.removesuffix(".weight")) for h in m.hf)
    return names


def check_targets(config: ModelConfig, targets: Sequence[str], where: str) -> None:
    """Every target names a module this family's adapters can target, once; else one line listing
    them."""
    valid = targetable(config)
    experts = _expert_names(config) - set(valid)
    for i, t in enumerate(targets):
        if t in targets[:i]:
            raise UserError(f"{t!r} is given twice; name each module once", where)
        if t in valid:
            continue
        if t in experts:
            raise UserError(
                f"{t!r} names the experts of the mixture of experts, which LoRA does not adapt; target "
                f"the attention projections or the router: {', '.join(valid)}",
                where,
            )
        raise UserError(f"{t!r} is no module a {config.family} adapter can target: {', '.join(valid)}", where)


def modules(config: ModelConfig, targets: Iterable[str], layers: Iterable[int] | None = None) -> list[str]:
    """Our module names the `targets` adapt, in the model's order (`layers`: a stage's only)."""
    wanted = set(targets)
    keep = None if layers is None else set(layers)
    return [
        ours  # "layers.<i>.<module>"
        for hf, ours, _ in _layer_maps(config)
        if _short(hf) in wanted and (keep is None or int(ours.split(".")[1]) in keep)
    ]


def adapter_settings(info: Adapter, dropout: float = 0.0, base_dtype: str | None = None) -> LoRA:
    """The settings an adapter checkpoint records, as `LoRA`; `dropout` and `base_dtype` are a
    run's own (training, QLoRA), not the adapter's."""
    return LoRA(info.rank, info.alpha, tuple(info.targets), dropout, info.rslora, base_dtype)


def check_rank(config: ModelConfig, lora: LoRA, where: str) -> None:
    """The rank is at most every targeted projection's smaller side (a larger one adds nothing but
    parameters: B A would have rank min(in, out) still)."""
    for hf, ours, shape in _layer_maps(config):
        if _short(hf) in lora.targets and lora.rank > min(shape):
            raise UserError(
                f"rank {lora.rank} is above {_short(hf)}'s size: {ours} is {shape[0]} x {shape[1]}", where
            )


def peft_names(config: ModelConfig) -> dict[str, str]:
    """Our module name -> PEFT's name of the same module in a saved adapter (without the tensor)."""
    return {ours: PEFT_PREFIX + hf for hf, ours, _ in _layer_maps(config)}
