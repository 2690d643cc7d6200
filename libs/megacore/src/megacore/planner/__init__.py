"""The planner (docs/mega-train.md, "Memory and layout planner"): what each rank of a layout holds
during a training step, the layouts of N GPUs that fit, ranked, and the longest sequence each fits.

Torch-free, like `parallel.layout`, whose rules it reads (mega-train's dry run uses it without
torch). It models this engine (the `Decoder`'s ops, `ParallelModel`'s wrapping, torch's pipeline
schedules), not transformers in general, in four parts:

- `memory`: each rank's bytes of weights, gradients, AdamW state, compute copies and buffers (the
  state exact against a live run), and its peak;
- `activations`: what autograd saves, op by op, and the microbatches a pipeline rank holds;
- `throughput`: a simple model of expected speed, to rank layouts, not to predict them;
- `search`: every tp x pp x cp x dp (x ep) layout of N GPUs with the least recompute that fits;
  `longest`: the longest sequence each layout fits.
"""

from megacore.planner.activations import in_flight, layer_activations, rank_activations, stage_activations
from megacore.planner.longest import MAX_SEQ, Longest, longest_sequence, longest_sequences
from megacore.planner.memory import (
    ALLOWANCE,
    GiB,
    RankMemory,
    State,
    estimate,
    peak,
    rank_buffers,
    rank_state,
    rollout_cache,
)
from megacore.planner.search import Candidate, candidate_parallelism, search
from megacore.planner.throughput import DP_EFFICIENCY, relative_throughput

__all__ = [
    "ALLOWANCE",
    "DP_EFFICIENCY",
    "MAX_SEQ",
    "Candidate",
    "GiB",
    "Longest",
    "RankMemory",
    "State",
    "candidate_parallelism",
    "estimate",
    "in_flight",
    "layer_activations",
    "longest_sequence",
    "longest_sequences",
    "peak",
    "rank_activations",
    "rank_buffers",
    "rank_state",
    "relative_throughput",
    "rollout_cache",
    "search",
    "stage_activations",
]
