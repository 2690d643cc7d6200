"""The planner's throughput model: how fast a layout is expected to train, relative to a perfect
machine of the same GPUs. Deliberately simple, not a measurement: it ranks layouts that fit
(`megacore.planner.search`), it does not predict tokens/s.

`relative_throughput` is the product of
- tensor parallel: 1 - 0.05·log2(tp) within a node (its all-reduces sit on the critical path),
  halved when the tp group spans nodes;
- the pipeline bubble: 1 - (pp-1)/(v·m + pp-1) (a third of that bubble for the zero-bubble
  schedules);
- recompute: forward and backward cost 3 forwards, full recompute adds a fourth (3/4); selective
  1/(1 + attention-core forward FLOPs / step FLOPs (`flops_per_token`));
- context parallel: 1 / (1 + r), r = a layer's k/v collectives' time over its compute time on a
  rank, for an H100-class GPU (400 TFLOP/s achieved; 400 GB/s within a node, 50 GB/s when the cp
  group spans nodes; 20 µs a collective): k and v all-gathered in the forward (again when
  recomputed) and reduce-scattered in the backward, none overlapped, each moving (cp-1)·T·kv·c;
  the compute T·`flops_per_token`/(layers·tp). Short sequences pay the latency, long ones little;
- expert parallel: 1 / (1 + r) likewise, r = a layer's all-to-alls' time over its compute: the
  routed rows sent to their experts and back in the forward, their gradients in the backward (and
  the forward's again with full recompute), each moving (ep-1)/ep·T·k·h·c, within a node while
  tp·cp·ep fits one;
- data parallel: 0.97 for dp x cp > 1 (FSDP2's gathers and reductions, mostly overlapped).
(T = micro batch x S / cp tokens, kv the tp-local width of k, c the compute dtype's bytes:
`megacore.planner.activations`.)
"""

from __future__ import annotations

import math

from megacore.config import ModelConfig
from megacore.parallel.dims import ZERO_BUBBLE, Parallelism
from megacore.parts.attention import kv_width
from megacore.planner.activations import COMPUTE_BYTES
from megacore.planner.counts import flops_per_token

GPUS_PER_NODE = 8
TP_COST = 0.05  # throughput lost per doubling of tp within a node
DP_EFFICIENCY = 0.97
# cp's and ep's exposed collectives in time, for an H100-class GPU: the FLOP/s a training step
# achieves, the bytes/s its link moves within a node (NVLink) and across nodes (InfiniBand), and a
# collective's latency.
ACHIEVED_FLOPS = 400e12
NODE_BANDWIDTH = 400e9
NETWORK_BANDWIDTH = 50e9
COLLECTIVE_LATENCY = 20e-6


def _cp_cost(config: ModelConfig, par: Parallelism, seq: int, micro: int, gpus_per_node: int) -> float:
    """Time of a layer's cp collectives over the time of its compute, for one microbatch on a rank.
    Each of k and v is all-gathered in the forward (again when recomputed) and its gradient
    reduce-scattered in the backward, every rank moving cp - 1 parts of T x kv width; none is
    overlapped with compute (`cp.py` waits for them)."""
    cp, tp, c = par.spec.cp, par.spec.tp, COMPUTE_BYTES[par.precision]
    tokens = micro * seq // cp
    passes = 2 if par.recompute == "none" else 3
    bandwidth = NODE_BANDWIDTH if tp * cp <= gpus_per_node else NETWORK_BANDWIDTH
    moved = (cp - 1) * tokens * kv_width(config, tp) * c
    comm = passes * 2 * (COLLECTIVE_LATENCY + moved / bandwidth)
    compute = tokens * flops_per_token(config, seq) / (config.num_layers * tp * ACHIEVED_FLOPS)
    return comm / compute


def _ep_cost(config: ModelConfig, par: Parallelism, seq: int, micro: int, gpus_per_node: int) -> float:
    """Time of a layer's ep all-to-alls over the time of its compute, for one microbatch on a rank:
    the routed rows (T x k) sent to their experts and back in the forward, and their gradients in
    the backward (again in the forward when recomputed in full), each moving the (ep-1)/ep of
    the rows that leave the rank; none overlapped. ep's ranks are tp x cp apart (`build_mesh`)."""
    ep, tp, c = par.spec.ep, par.spec.tp, COMPUTE_BYTES[par.precision]
    tokens = micro * seq
    passes = 6 if par.recompute == "full" else 4
    bandwidth = NODE_BANDWIDTH if tp * par.spec.cp * ep <= gpus_per_node else NETWORK_BANDWIDTH
    moved = (ep - 1) / ep * tokens * config.moe.experts_per_token * config.hidden_size * c
    comm = passes * (COLLECTIVE_LATENCY + moved / bandwidth)
    compute = tokens * flops_per_token(config, seq) / (config.num_layers * tp * ACHIEVED_FLOPS)
    return comm / compute


def relative_throughput(
    config: ModelConfig,
    par: Parallelism,
    dp: int,
    seq: int,
    gpus_per_node: int = GPUS_PER_NODE,
    micro: int = 1,
) -> float:
    """Expected throughput relative to a perfect machine of the same GPUs (module docstring)."""
    tp, P, v, m = par.spec.tp, par.spec.pp, par.stages_per_rank, par.microbatches
    eff = 1.0 - TP_COST * math.log2(min(tp, gpus_per_node))
    if tp > gpus_per_node:
        eff *= 0.5
    if P > 1:
        bubble = (P - 1) / (v * m + P - 1)
        eff *= 1.0 - (bubble / 3 if par.spec.schedule in ZERO_BUBBLE else bubble)
    if par.recompute == "full":
        eff *= 0.75
    elif par.recompute == "selective":
        attention_forward = 4.0 * config.num_layers * config.num_heads * config.head_dim * seq
        eff /= 1.0 + attention_forward / flops_per_token(config, seq)
    if par.spec.cp > 1:
        eff /= 1.0 + _cp_cost(config, par, seq, micro, gpus_per_node)
    if par.spec.ep > 1:
        eff /= 1.0 + _ep_cost(config, par, seq, micro, gpus_per_node)
    if par.dims(dp).replicas > 1:  # FSDP2 over dp x cp
        eff *= DP_EFFICIENCY
    return eff
