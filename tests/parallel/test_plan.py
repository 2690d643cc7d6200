"""Layout planning and the checks that refuse an impossible layout (each with its message)."""

from __future__ import annotations

import msgspec
import pytest

from megacore.artifacts.run_spec import ParallelSpec
from megacore.config import ModelConfig
from megacore.errors import UserError
from megacore.parallel import (
    Dims,
    Parallelism,
    check_microbatches,
    check_parallelism,
    check_tp,
    place,
    split_optim_name,
    stage_layers,
    stage_of,
)
from megacore.parts import model_tensors

CFG = ModelConfig(
    family="llama", vocab_size=100, padded_vocab_size=128, hidden_size=64, num_layers=10, num_heads=8,
    num_kv_heads=4, ffn_hidden_size=256,
)  # fmt: skip


def cfg(**kw) -> ModelConfig:
    return msgspec.structs.replace(CFG, **kw)


def refused(fn, *args, match: str, **kw) -> UserError:
    with pytest.raises(UserError, match=match) as e:
        fn(*args, **kw)
    assert "\n" not in str(e.value)
    return e.value


def test_tp_must_divide_heads() -> None:
    refused(check_tp, CFG, 3, match="tp 3 does not divide the 8 attention heads")


def test_tp_must_divide_kv_heads_or_be_a_multiple() -> None:
    check_tp(CFG, 4)
    check_tp(CFG, 8)  # 4 kv heads < tp 8: replicated, allowed
    c12 = cfg(num_heads=12, num_kv_heads=4, ffn_hidden_size=240, padded_vocab_size=120)
    check_tp(c12, 12)  # a multiple of the 4 kv heads
    refused(check_tp, c12, 6, match="tp 6 is neither a divisor nor a multiple of the 4 kv heads")
    refused(check_tp, cfg(num_heads=12, num_kv_heads=6), 4, match="tp 4 does not divide the 6 kv heads")


def test_tp_must_divide_ffn_and_padded_vocab() -> None:
    refused(check_tp, cfg(ffn_hidden_size=100), 8, match="ffn hidden size 100")
    e = refused(check_tp, cfg(padded_vocab_size=None), 8, match="padded vocab size 100")
    assert e.where == "tp"
    check_tp(cfg(padded_vocab_size=None, vocab_size=104), 8)


def test_pp_must_not_exceed_layers_and_counts_must_fit() -> None:
    assert stage_layers(10, 4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert stage_layers(10, 2, [3, 7]) == [[0, 1, 2], list(range(3, 10))]
    refused(stage_layers, 10, 11, match="11 pipeline stages exceed the model's 10 layers")
    refused(stage_layers, 10, 2, [5, 4], match="sum to 9, the model has 10")
    refused(stage_layers, 10, 2, [5, 5, 0], match="3 per-stage layer counts given for 2 stages")
    refused(stage_layers, 10, 2, [10, 0], match="at least one layer")


def test_world_must_be_a_multiple_of_tp_pp() -> None:
    assert Dims.for_world(8, 2, 2) == Dims(tp=2, pp=2, dp=2)
    refused(Dims.for_world, 6, 2, 2, match="world size 6 is not a multiple of tp\\*pp = 2\\*2")
    par = Parallelism(ParallelSpec(tp=2, pp=2), microbatches=2)
    assert Dims.for_world(4, 2, 2).dp == 1 and check_parallelism(CFG, par) == [
        list(range(5)),
        list(range(5, 10)),
    ]
    refused(Dims.for_world, 8, 1, 1, 1, 3, match="ep 3 does not divide dp 8")
    interleaved = Parallelism(
        ParallelSpec(pp=2, schedule="interleaved1f1b", virtual_stages=2), microbatches=2
    )
    assert len(check_parallelism(CFG, interleaved)) == 4


def test_cp_needs_equal_chunks_and_sequence_parallel_a_split_part() -> None:
    """cp cuts a sequence into 2 x cp chunks; sequence parallel then cuts each rank's part over tp."""
    assert Dims.for_world(8, 2, 1, cp=2).dp == 2
    refused(Dims.for_world, 8, 2, 1, cp=3, match="world size 8 is not a multiple of tp\\*pp\\*cp = 2\\*1\\*3")
    Dims(tp=2, cp=4).check_seq_length(4096, True)
    refused(Dims(cp=4).check_seq_length, 100, False, match="seq_length 100 is not a multiple of 8")
    refused(Dims(tp=4, cp=2).check_seq_length, 20, True, match="each cp rank's 10 tokens over tp 4")
    Dims(tp=4, cp=2).check_seq_length(
        20, False
    )  # without sequence parallel the part stays whole on every tp rank
    # The multiple a sequence must be, worked out from the two rules: 2 x cp, and cp x tp with SP.
    assert [
        Dims(tp=t, cp=c).seq_multiple(sp)
        for t, c, sp in [(4, 1, True), (4, 2, False), (4, 2, True), (2, 4, True), (3, 2, True)]
    ] == [1, 4, 8, 8, 12]


def test_the_mesh_arithmetic_follows_the_rank_order() -> None:
    """Ranks run (pp, dp, cp, tp), tp fastest: the replica index and the global rank, worked out by
    enumerating the mesh in that order; the label is the dry run's."""
    d = Dims(tp=2, pp=2, cp=2, dp=3, ep=3)
    order = [(p, r, c, t) for p in range(2) for r in range(3) for c in range(2) for t in range(2)]
    assert [d.rank(p, d.replica(r, c), t) for p, r, c, t in order] == list(range(d.world)) == list(range(24))
    assert (d.replicas, d.edp) == (6, 1)
    assert d.label == "tp 2 x pp 2 x cp 2 x dp 3 (ep 3)"
    assert Dims(tp=2, dp=4).label == "tp 2 x pp 1 x dp 4"


def test_the_batch_divides_into_micro_batches_of_every_dp_rank() -> None:
    assert Dims(dp=4).microbatches(64, 2) == 8
    refused(Dims(dp=3).microbatches, 64, 2, match="64 is not a multiple of micro_batch_size \\* dp = 2 \\* 3")


def test_microbatches_must_divide_the_batch() -> None:
    assert check_microbatches(8, 4) == 2
    refused(check_microbatches, 8, 3, match="3 microbatches do not divide the batch of 8")
    refused(check_microbatches, 8, 0, match="at least 1")


def test_placement_follows_the_contract() -> None:
    layers = stage_layers(10, 2)
    assert place("embed.weight", CFG, 2).tp_dim == 0
    assert stage_of(place("lm_head.weight", CFG, 2), layers) == 1
    assert place("layers.3.attn.q_proj.weight", CFG, 2).tp_dim == 0
    assert place("layers.3.attn.k_proj.weight", CFG, 4).tp_dim == 0
    assert place("layers.3.attn.k_proj.weight", CFG, 8).tp_dim is None  # 4 kv heads < tp 8
    assert place("layers.3.attn.o_proj.weight", CFG, 2).tp_dim == 1
    assert place("layers.3.attn.o_proj.bias", CFG, 2).tp_dim is None
    assert place("layers.3.mlp.down_proj.weight", CFG, 2).tp_dim == 1
    assert place("layers.3.mlp_norm.weight", CFG, 2).tp_dim is None
    assert stage_of(place("optim.exp_avg.layers.7.mlp.up_proj.weight", CFG, 2), layers) == 1
    assert split_optim_name("optim.exp_avg_sq.norm.weight") == ("exp_avg_sq", "norm.weight")
    refused(place, "layers.3.attn.rotary.inv_freq", CFG, 2, match="not a name of the model contract")
    refused(place, "layers.12.attn.q_proj.weight", CFG, 2, match="beyond num_layers")
    for name in model_tensors(CFG):
        place(name, CFG, 8)


def test_engine_checks_schedule_and_stages() -> None:
    def par(microbatches: int = 1, **spec) -> Parallelism:
        return Parallelism(ParallelSpec(**spec), microbatches=microbatches)

    refused(check_parallelism, CFG, par(schedule="dualpipe"), match="unknown schedule 'dualpipe'")
    refused(check_parallelism, CFG, par(2, pp=2, virtual_stages=2), match="virtual_stages must be 1")
    refused(check_parallelism, CFG, par(2, pp=4), match="2 microbatches are fewer than the 4")
    # Tied embeddings under pp are the engine's (the last stage holds a copy): planned like any.
    assert check_parallelism(cfg(tie_embeddings=True), par(2, pp=2)) == check_parallelism(CFG, par(2, pp=2))
    refused(check_parallelism, CFG, par(tp=3), match="tp 3 does not divide")
    interleaved = par(2, pp=2, schedule="interleaved1f1b", virtual_stages=2)
    assert check_parallelism(CFG, interleaved) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert interleaved.rank_stages(1) == [1, 3]
    assert par(2, pp=2, schedule="zbv").rank_stages(0) == [0, 3]
