"""Sparse mixture of experts, the MLP of a block when the config's `mlp` is one (Mixtral), but for
its `dense_layers`.

Routing as transformers' Mixtral and Qwen 3 MoE compute it: router logits from a bias-free
linear, an fp32 softmax, the top `experts_per_token` probabilities, renormalised to sum to 1
(Mixtral; Qwen 3 MoE when its norm_topk_prob is set: `renormalize_top_k`). Dropless: every
token reaches its experts whatever the load. The (token, expert) pairs are sorted by expert, so
each expert runs its SwiGLU as one matmul per projection over a contiguous block of rows
(`grouped_swiglu`: `torch._grouped_mm` on a GPU in bf16, a loop over the experts elsewhere); each
output is scaled by its routing weight and added back to its token. A shared expert (Qwen 2 MoE) is
a dense MLP every token goes through, its output scaled by sigmoid(`shared_expert_gate`) and added
to the routed experts' (transformers' order of the sum). gpt-oss's experts: a router with a bias,
biases on every expert's projections and the clamped SwiGLU (`GLU`).

The router's losses are not returned through the model's output (a pipeline stage sends hidden
states only): each MoE layer attaches its load-balancing loss (`load_balancing_loss`, Mixtral's,
of this layer's tokens) and its z-loss to its output's backward with the weights `aux_weight`
and `z_weight` (`AttachLoss`, as Megatron-Core's aux-loss scaler), which the engine sets from the
config's coefficients and the step's scaling. Each layer also keeps the statistics of its forwards
(tokens per expert, the losses' values) in `stats` for the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megacore.config import ModelConfig


@dataclass(frozen=True)
class GLU:
    """A gated MLP's activation of (gate, up): silu(gate) · up (swiglu), gelu_tanh(gate) · up
    (geglu_tanh: transformers' gelu_pytorch_tanh, Gemma), or gpt-oss's clamped SwiGLU: gate
    clamped to at most `limit`, up to ±`limit`, (up + 1) · gate · sigmoid(`alpha` · gate)."""

    kind: str = "swiglu"
    alpha: float = 1.702
    limit: float = 7.0

    @classmethod
    def of(cls, config: ModelConfig) -> GLU:
        return cls(config.activation, config.swiglu_alpha, config.swiglu_limit)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "clamped_swiglu":  # transformers' GptOssExperts order of operations
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        if self.kind == "geglu_tanh":
            return F.gelu(gate, approximate="tanh") * up
        return F.silu(gate) * up


class GroupedLinear(nn.Module):
    """`num_experts` linears, their weights stacked: [experts, out, in], biases [experts, out]."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features)) if bias else None


class Experts(nn.Module):
    """The experts of one layer: gated MLPs (`GLU`), each its own gate, up and down projections."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, bias = config.moe.num_experts, config.mlp_bias
        hidden, ffn = config.hidden_size, config.ffn_hidden_size
        self.gate_proj = GroupedLinear(e, hidden, ffn, bias)
        self.up_proj = GroupedLinear(e, hidden, ffn, bias)
        self.down_proj = GroupedLinear(e, ffn, hidden, bias)
        self.glu = GLU.of(config)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, *params: torch.Tensor | None) -> torch.Tensor:
        """Rows [N, hidden] grouped by expert, `counts` [experts] rows each -> [N, hidden].
        `params` (gate, up, down weights and gate, up, down biases, None where absent), when given,
        replace the module's own: under expert parallel (`megacore.parallel.ep`) the rows are those
        sent to this rank's experts and the parameters its local shards, which ep hands in as tp
        hands a linear its shard (the down bias after the sum over tp: None here)."""
        if not params:
            projs = (self.gate_proj, self.up_proj, self.down_proj)
            params = (*(p.weight for p in projs), *(p.bias for p in projs))
        return grouped_swiglu(rows, counts, *params, act=self.glu)


def grouped_swiglu(
    x: torch.Tensor,
    counts: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    act: GLU = GLU(),
) -> torch.Tensor:
    """The gated MLP of each expert over its block of rows: x [N, hidden] sorted by expert,
    `counts` [E] rows per expert, weights [E, out, in], biases [E, out] -> [N, hidden]."""
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        offsets = counts.cumsum(0).to(torch.int32)

        def mm(rows: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            out = torch._grouped_mm(rows, w.transpose(-2, -1), offs=offsets)
            return out if b is None else out + b.repeat_interleave(counts, dim=0, output_size=x.shape[0])

        return mm(act(mm(x, gate, gate_bias), mm(x, up, up_bias)), down, down_bias)
    # unbind, not gate[e]: autograd stacks the experts' weight gradients once per projection,
    # where indexing would allocate (and zero) a whole stacked gradient per expert.
    ws = [t.unbind(0) for t in (gate, up, down)]
    bs = [(None,) * gate.shape[0] if b is None else b.unbind(0) for b in (gate_bias, up_bias, down_bias)]
    # Experts without rows too: an empty product keeps the output a function of x, so backward
    # always reaches what made x (under ep an all-to-all whose peers wait for it).
    outs = [
        F.linear(
            act(F.linear(rows, ws[0][e], bs[0][e]), F.linear(rows, ws[1][e], bs[1][e])), ws[2][e], bs[2][e]
        )
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
        moe, router = config.moe, config.moe.router
        self.top_k, self.renormalize = moe.experts_per_token, router.renormalize_top_k
        self.router = nn.Linear(config.hidden_size, moe.num_experts, bias=config.mlp_bias)
        # DeepSeek V3: sigmoid scores, the balancing bias (no gradient: the engine moves it towards
        # even loads, `router_bias_update`), groups of experts, scaled weights.
        self.sigmoid, self.scaling = router.scoring == "sigmoid", router.scaling
        self.groups = None if router.groups is None else (router.groups, router.groups_chosen)
        bias = torch.zeros(moe.num_experts) if router.bias else None
        self.router_bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.experts = Experts(config)
        # Qwen 2 MoE's shared expert (the decoder's dense MLP, handed in) and its sigmoid gate.
        self.shared_expert = shared_expert
        gated = shared_expert is not None and moe.shared_expert.gate
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
