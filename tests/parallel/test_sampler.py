"""The sampler in a layout (`megacore.parallel.sampler`) equals it in one process: the same fresh
weights (seed 0, the same in every layout), the same prompts of different lengths, greedy and drawn
(top-p 0.9, seed 5) completions, on every rank, under torchrun on 2 processes: tp 2 (each rank
caching its own heads, the logits' vocab shards gathered), pp 2 (each rank its stage's layers; and
zbv's two stages a rank, the last on the first rank), dp 2 (FSDP2) and a mixture of experts at ep 2; cp, sequence
parallel, compiled blocks and fp8 are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch

from helpers import torchrun_script
from megacore.artifacts.run_spec import ParallelSpec
from megacore.config import ModelConfig
from megacore.errors import UserError
from megacore.models import Decoder
from megacore.models.sampling import sample
from megacore.parallel.layout import Parallelism
from megacore.parallel.sampler import check_sampler_layout, runs_sampler
from parallel.sample_worker import DRAWN

WORKER = Path(__file__).with_name("sample_worker.py")
LLAMA = {"family": "llama", "vocab_size": 96, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
         "num_kv_heads": 2, "ffn_hidden_size": 64, "max_seq_len": 64}  # fmt: skip
MIXTRAL = {**LLAMA, "family": "mixtral", "mlp": {"type": "moe", "num_experts": 4, "experts_per_token": 2}}
PROMPTS = [[5, 17, 33, 2, 40], [9, 81, 3, 3, 60, 12, 7, 1], [44, 45]]
LLAMA4 = {**LLAMA, "num_layers": 4}
CASES = {
    "tp2": {"config": LLAMA, "tp": 2},
    "pp2": {"config": LLAMA, "pp": 2},
    "pp2-zbv": {"config": LLAMA4, "pp": 2, "schedule": "zbv"},  # stages 0 and 3 on rank 0,
    "dp2": {"config": LLAMA},
    "ep2": {"config": MIXTRAL, "ep": 2},
}


def one_process(config: dict) -> dict[str, list[list[int]]]:
    model = Decoder(msgspec.convert(config, ModelConfig), attention="sdpa")
    model.init_weights(seed=0)
    with torch.no_grad():
        return {"greedy": sample(model.eval(), PROMPTS, 10), "drawn": sample(model, PROMPTS, 10, DRAWN)}


# 5-6 s each: make test runs zbv's pipeline (two stages a rank, the last on the first rank) and the
# sampler at tp 2 in tests/train/test_harness.py (lm-eval's generate_until on a LoRA adapter's model,
# against transformers on its merged export); the other layouts in make test-slow.
@pytest.mark.dist
@pytest.mark.parametrize(
    "layout", [c if c == "pp2-zbv" else pytest.param(c, marks=pytest.mark.slow) for c in CASES]
)
def test_the_sampler_in_a_layout_equals_one_process(tmp_path: Path, layout: str) -> None:
    case = {**CASES[layout], "prompts": PROMPTS, "new": 10}
    torchrun_script(2, WORKER, json.dumps(case), tmp_path)
    want = one_process(case["config"])
    assert want["greedy"] != want["drawn"]  # the draws are not the greedy choices
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == want, rank


@pytest.mark.parametrize(
    ("par", "name"),
    [
        (Parallelism(ParallelSpec(cp=2)), "cp"),
        (Parallelism(ParallelSpec(tp=2, sequence_parallel=True)), "sequence_parallel"),
        (Parallelism(ParallelSpec(), compile=True), "compile"),
        (Parallelism(ParallelSpec(), "fp8"), "precision fp8"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_layouts_the_sampler_does_not_run_yet_are_one_line(par: Parallelism, name: str) -> None:
    """There the Generator's forwards serve samples and lm-eval (`runs_sampler` false)."""
    assert not runs_sampler(par) and runs_sampler(Parallelism(ParallelSpec(tp=2, pp=2)))
    with pytest.raises(UserError) as e:
        check_sampler_layout(par, "$.samples")
    assert str(e.value) == f"$.samples: the sampler does not run under {name} yet"
