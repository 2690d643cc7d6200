"""The model naming contract (`megacore.parts.model_tensors`) is the Decoder's state dict: same
names, same order, same shapes, for every family variant and preset, whole and as pipeline stages."""

from __future__ import annotations

import pytest
import torch

from hf_cases import CASES
from megacore.config import ModelConfig
from megacore.models import Decoder, config_from_hf
from megacore.parts import model_tensors


def _configs() -> dict[str, ModelConfig]:
    out = {}
    for name, (cls, kwargs, _) in CASES.items():
        out[f"hf-{name}"] = config_from_hf(cls(**kwargs), pad_multiple=64)
    return out


CONFIGS = _configs()


def _parts(n: int) -> list[tuple[list[int] | None, bool, bool]]:
    """(layers, embed, head): the whole model, first / middle / last pipeline stages, a lone block."""
    parts = [(None, True, True), ([0], True, False), ([n - 1], False, True), ([n - 1], False, False)]
    if n >= 3:
        parts.append((list(range(1, n - 1)), False, False))
        parts.append((list(range(n // 2, n)), False, True))
    return parts


@pytest.mark.parametrize("name", list(CONFIGS))
def test_model_tensors_is_the_decoder_state_dict(name: str) -> None:
    cfg = CONFIGS[name]
    for layers, embed, head in _parts(cfg.num_layers):
        with torch.device("meta"):
            model = Decoder(cfg, layers=layers, embed=embed, head=head)
        got = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
        expected = list(model_tensors(cfg, layers, embed=embed, head=head).items())
        assert got == expected, (name, layers, embed, head)
        # The parameters are the state dict (no buffers), each named once even when tied.
        assert [k for k, _ in model.named_parameters()] == [k for k, _ in got], (name, layers, embed, head)
