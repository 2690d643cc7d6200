"""Qwen 3.5's linear attention refused where it cannot go, in one line naming what and where: a
config.json layer type we do not have, a tp that does not divide its heads, context parallel
(the state would have to cross ranks). Its computation: test_delta_rule.py, test_packing.py,
tests/families (Qwen 3.5's row: parity with transformers, tp 2, pp 2, the planner)."""

from __future__ import annotations

import msgspec
import pytest

from megacore.artifacts.run_spec import ParallelSpec
from megacore.errors import UserError
from megacore.models.families import config_from_hf
from megacore.parallel.dims import Parallelism
from megacore.parallel.layout import check_parallelism, check_tp

QWEN35 = {
    "model_type": "qwen3_5_text", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
    "linear_num_key_heads": 2, "linear_num_value_heads": 6, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "layer_types": ["linear_attention", "full_attention"],
}  # fmt: skip


def test_a_layer_type_we_do_not_have_is_named() -> None:
    with pytest.raises(UserError) as e:
        config_from_hf({**QWEN35, "layer_types": ["linear_attention", "mamba"]}, where="config.json")
    assert str(e.value) == (
        "config.json: $.layer_types[1]: 'mamba' is not a layer type here (linear_attention, full_attention)"
    )


def test_a_tp_that_does_not_divide_the_linear_heads_is_refused() -> None:
    config = config_from_hf(QWEN35)
    check_tp(config, 2)  # 2 key heads, 6 value heads: 3 each
    with pytest.raises(UserError, match=r"^tp: linear_attention.key_heads 2 is not divisible by tp 4$"):
        check_tp(msgspec.structs.replace(config, num_heads=8, head_dim=16), 4)


def test_context_parallel_is_refused_for_linear_layers() -> None:
    config = config_from_hf(QWEN35)
    with pytest.raises(UserError) as e:
        check_parallelism(config, Parallelism(ParallelSpec(cp=2)), "run.json: $.parallel")
    assert str(e.value) == (
        "run.json: $.parallel.cp: cp splits rows across ranks, which linear attention's state cannot "
        "cross here: cp 1"
    )
