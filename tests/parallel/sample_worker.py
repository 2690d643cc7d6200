"""torchrun worker for tests/parallel/test_sampler.py: the sampler (`parallel.sampler`) on a
ParallelModel of a tiny model, fresh weights from seed 0, in the layout argv[1] gives (JSON: config,
tp, pp and its schedule, ep, prompts); every rank's completions, greedy and drawn, written to argv[2] as rank<r>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import torch.distributed as dist

from megacore.artifacts.run_spec import ParallelSpec
from megacore.config import ModelConfig
from megacore.models.sampling import Sampling
from megacore.parallel.engine import ParallelModel
from megacore.parallel.layout import Parallelism
from megacore.parallel.mesh import build_mesh, init_distributed, shutdown
from megacore.parallel.sampler import sample_parallel

DRAWN = Sampling(1.0, top_p=0.9, seed=5)


def main() -> None:
    case, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    init_distributed()
    spec = ParallelSpec(
        tp=case.get("tp", 1),
        pp=case.get("pp", 1),
        ep=case.get("ep", 1),
        schedule=case.get("schedule", "1f1b"),
    )
    mesh = build_mesh(spec.tp, spec.pp, 1, spec.ep)
    pm = ParallelModel(
        msgspec.convert(case["config"], ModelConfig),
        Parallelism(spec, "fp32", 2 * spec.pp, attention="sdpa"),
        mesh,
        "cpu",
    )
    pm.init_weights(seed=0)
    prompts, new = case["prompts"], case["new"]
    got = {"greedy": sample_parallel(pm, prompts, new), "drawn": sample_parallel(pm, prompts, new, DRAWN)}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(got))
    shutdown()


if __name__ == "__main__":
    main()
