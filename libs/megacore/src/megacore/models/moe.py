"""Sparse mixture of experts, the MLP of a block when the config has `num_experts` (Mixtral), but
for its `dense_layers`.

Routing as transformers' Mixtral and Qwen 3 MoE compute it: router logits from a bias-free
linear, an fp32 softmax, the top `experts_per_token` probabilities, renormalised to sum to 1
(Mixtral; Qwen 3 MoE when its norm_topk_prob is set: `renormalize_top_k`). Dropless: every
token reaches its experts whatever the load. The (token, expert) pairs are sorted by expert, so
each expert runs its SwiGLU as one matmul per projection over a contiguous block of rows
(`grouped_swiglu`: `torch._grouped_mm` on a GPU in bf16, a loop over the experts elsewhere); each
output is scaled by its routing weight and added back to its token. A shared expert (Qwen 2 MoE) is
a dense MLP every token goes through, its output scaled by sigmoid(`shared_expert_gate`) and added
to the routed experts' (transformers' order of the sum).

The router's losses are not returned through the model's output (a pipeline stage sends hidden
states only): each MoE layer attaches its load-balancing loss (`load_balancing_loss`, Mixtral's,
of this layer's tokens) and its z-loss to its output's backward with the weights `aux_weight`
and `z_weight` (`AttachLoss`, as Megatron-Core's aux-loss scaler), which the engine sets from the
config's coefficients and the step's scaling. Each layer also keeps the statistics of its forwards
(tokens per expert, the losses' values) in `stats` for the metrics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megacore.config import ModelConfig


class GroupedLinear(nn.Module):
    """`num_experts` linears without bias, their weights stacked: [experts, out, in]."""

    def __init__(self, num_experts: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))


class Experts(nn.Module):
    """The experts of one layer: SwiGLU, each its own gate, up and down projections."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, hidden, ffn = config.num_experts, config.hidden_size, config.ffn_hidden_size
        self.gate_proj = GroupedLinear(e, hidden, ffn)
        self.up_proj = GroupedLinear(e, hidden, ffn)
        self.down_proj = GroupedLinear(e, ffn, hidden)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        """Rows [N, hidden] grouped by expert, `counts` [experts] rows each -> [N, hidden].
        `weights` (gate, up, down), when given, replace the module's own: under expert parallel
        (`megacore.parallel.ep`) the rows are those sent to this rank's experts and the weights
        its local shards, which ep hands in as tp hands a linear its shard."""
        if not weights:
            weights = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        return grouped_swiglu(rows, counts, *weights)


def grouped_swiglu(
    x: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """SwiGLU of each expert over its block of rows: x [N, hidden] sorted by expert, `counts` [E]
    rows per expert, weights [E, out, in] -> [N, hidden]."""
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        offsets = counts.cumsum(0).to(torch.int32)
        g = torch._grouped_mm(x, gate.transpose(-2, -1), offs=offsets)
        u = torch._grouped_mm(x, up.transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(F.silu(g) * u, down.transpose(-2, -1), offs=offsets)
    # unbind, not gate[e]: autograd stacks the experts' weight gradients once per projection,
    # where indexing would allocate (and zero) a whole stacked gradient per expert.
    gates, ups, downs = gate.unbind(0), up.unbind(0), down.unbind(0)
    # Experts without rows too: an empty product keeps the output a function of x, so backward
    # always reaches what made x (under ep an all-to-all whose peers wait for it).
    outs = [
        F.linear(F.silu(F.linear(rows, gates[e])) * F.linear(rows, ups[e]), downs[e])
        for e, rows in enumerate(x.split(counts.tolist()))
    ]
    return torch.cat(outs)


def route(
    logits: torch.Tensor, k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probabilities [T, E] in fp32, the top-k weights [T, k], renormalised to sum to 1 or not,
    the chosen experts [T, k]) from router logits, as transformers' MixtralTopKRouter and
    Qwen3MoeTopKRouter."""
    probs = F.softmax(logits.float(), dim=-1)
    top, chosen = torch.topk(probs, k, dim=-1)
    return probs, top / top.sum(dim=-1, keepdim=True) if renormalize else top, chosen


def route_sigmoid(
    logits: torch.Tensor,
    k: int,
    renormalize: bool,
    bias: torch.Tensor | None,
    groups: tuple[int, int] | None,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek V3's routing, as transformers' DeepseekV3TopkRouter: (sigmoid scores [T, E] in fp32,
    the top-k weights [T, k], the chosen experts [T, k]). A token chooses by its scores plus `bias`
    (the auxiliary-loss-free balancing bias) among the experts of its best `groups[1]` of `groups[0]`
    groups (a group scored by its two best); the weights are its plain scores of the chosen,
    renormalised (+1e-20) or not, times `scaling`."""
    scores = torch.sigmoid(logits.float())
    choice = scores if bias is None else scores + bias.float()
    if groups is not None:
        n, best = groups
        grouped = choice.view(-1, n, choice.shape[-1] // n)
        top = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, groups]
        keep = torch.zeros_like(top).scatter_(1, top.topk(best, dim=-1).indices, 1.0).bool()
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
    chosen = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, chosen)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return scores, weights * scaling, chosen


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Mixtral's (Switch Transformer's) load-balancing loss of one layer's tokens: experts x the sum
    over experts of (the fraction of tokens that chose it) x (its mean router probability): k when
    balanced, up to the number of experts when every token chooses the same experts and puts all
    its probability on them; the gradient flows through the probabilities only. transformers' `load_balancing_loss_func`
    pools every layer's statistics before the product; this is its value for one layer, and a
    model's is the mean over its layers (the same for one layer), which pipeline stages can each
    compute for their own layers."""
    fraction = counts.float() / probs.shape[0]  # counts: top-k choices per expert
    return probs.shape[-1] * (fraction * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2 (keeps the logits small)."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


class AttachLoss(torch.autograd.Function):
    """Identity on `y`; backward also gives `loss` (already weighted) the gradient 1, so the loss's
    gradient joins the model's without passing through its output."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)


class MoEStats:
    """One layer's statistics since the last `reset`, one entry per forward, kept on the device (no
    sync per layer): tokens per expert and the two router losses' values."""

    def __init__(self) -> None:
        self.entries: list[tuple[torch.Tensor, torch.Tensor]] = []

    def reset(self) -> None:
        self.entries.clear()

    def add(self, counts: torch.Tensor, aux: torch.Tensor, z: torch.Tensor) -> None:
        self.entries.append((counts.float(), torch.stack([aux, z]).float()))

    def totals(self, last: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens per expert, [aux, z]) summed over the `last` forwards (None: all). A pipeline
        schedule's first step runs each stage once more on made-up inputs to learn the shapes
        (torch's metadata inference) before the step's microbatches: their last forwards."""
        counts, losses = zip(*self.entries[-last if last else 0 :], strict=True)
        return torch.stack(counts).sum(0), torch.stack(losses).sum(0)


class MoE(nn.Module):
    """The sparse MLP: router, experts, and the router's losses attached to the output."""

    aux_weight = 0.0  # the gradient weight of this layer's load-balancing loss (the engine sets it)
    z_weight = 0.0  # of its z-loss

    def __init__(self, config: ModelConfig, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.top_k, self.renormalize = config.experts_per_token, config.renormalize_top_k
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        # DeepSeek V3: sigmoid scores, the balancing bias (no gradient: the engine moves it towards
        # even loads, `router_bias_update`), groups of experts, scaled weights.
        self.sigmoid, self.scaling = config.router_scoring == "sigmoid", config.routed_scaling
        self.groups = (
            None if config.expert_groups is None else (config.expert_groups, config.expert_groups_chosen)
        )
        bias = torch.zeros(config.num_experts) if config.router_bias else None
        self.router_bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.experts = Experts(config)
        # Qwen 2 MoE's shared expert (the decoder's dense MLP, handed in) and its sigmoid gate.
        self.shared_expert = shared_expert
        gated = shared_expert is not None and config.shared_expert_gate
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if gated else None
        self.stats = MoEStats()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat)
        if self.sigmoid:
            probs, weights, chosen = route_sigmoid(
                logits, self.top_k, self.renormalize, self.router_bias, self.groups, self.scaling
            )
        else:
            probs, weights, chosen = route(logits, self.top_k, self.renormalize)
        counts = torch.bincount(chosen.reshape(-1), minlength=probs.shape[-1])
        order = chosen.reshape(-1).argsort(stable=True)  # the (token, expert) pairs grouped by expert
        token = order // self.top_k
        out = self.experts(flat.index_select(0, token), counts)
        # The routing weight in fp32, rounded once on the way back (transformers' order).
        out = (out * weights.reshape(-1)[order, None]).to(x.dtype)
        y = flat.new_zeros(flat.shape).index_add_(0, token, out)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            y = y + shared
        aux = load_balancing_loss(probs, counts)
        z = router_z_loss(logits)
        # Recompute (activation checkpointing) runs the forward again inside backward: count once.
        if torch._C._current_graph_task_id() == -1:
            self.stats.add(counts, aux.detach(), z.detach())
        if torch.is_grad_enabled() and (self.aux_weight or self.z_weight):
            y = AttachLoss.apply(y, aux * self.aux_weight + z * self.z_weight)
        return y.view_as(x)
