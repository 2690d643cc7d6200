"""The one decoder every family is built from: a plain nn.Module, no parallel code inside.

Names and shapes follow the model naming contract (`megacore.parts.model_tensors`, shared
with the parallel layout, mega-shard and the converters; state-dict names are checkpoint tensor
names). Tensor and pipeline parallelism are applied from outside (docs/architecture.md): heads are
counted from the (possibly sharded) projection outputs, a pipeline stage keeps a subset of `layers`
and drops `embed` or `norm`/`lm_head` by setting them to None.

Everything a Decoder does is chosen when it is built: the attention kernel, activation recompute
and the single-device fast paths (`FastPaths`: the q/k/v and gate/up matmuls, the norms'
hand-written backward), which a parallel plan whose DTensor shards need the plain module code
builds it without (`parallel.build_rules.fast_paths`). The loss fused with the output projection is
`forward(x, targets)`; a caller whose logits are vocab-parallel asks for logits instead. Fresh
weights come from `initial_value`, a function of the tensor's name and the seed only, so a model
initialised in any layout holds the same weights.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megacore.config import (
    GATED_ACTIVATIONS,
    LORA_A,
    LORA_B,
    ModelConfig,
    attention_window,
    linear_layer,
    local_rope,
    mlp_width,
    rope_dim,
    sparse_layer,
)
from megacore.config_parts import PlusOneRMSNormSpec
from megacore.models.attention import Impl, causal_attention, document_ids, suffix_attention
from megacore.models.kv_cache import KVCache
from megacore.models.layers import FastPaths, HeadWeights, RMSNorm, make_norm, project
from megacore.models.linear_attention import GatedDeltaNet
from megacore.models.loss import fused_linear_cross_entropy
from megacore.models.moe import GLU, MoE
from megacore.models.rope import apply_rope, latent_attention_scale, rope_tables


class Attention(nn.Module):
    """Causal self-attention of layer `layer`: its window (`attention_window`: Gemma 3's local
    layers slide, its global ones do not), its RoPE tables (`local_rope`: the caller passes them),
    the score scale (head_dim ** -0.5, or its `scalar` ** -0.5) and its sinks: `config.attention`, a
    `StandardAttentionSpec`."""

    # The attention core; context parallel (`megacore.parallel.cp`) sets its own.
    kernel = staticmethod(causal_attention)

    def __init__(
        self,
        config: ModelConfig,
        layer: int = 0,
        impl: Impl = "auto",
        recompute: bool = False,
        fast: FastPaths = FastPaths(),
    ) -> None:
        super().__init__()
        hd, hidden = config.head_dim, config.hidden_size
        self.head_dim, self.layer = hd, layer
        self.rotary = rope_dim(config)  # the rotated dims of each head, the first ones
        self.window = attention_window(config, layer)
        self.local_rope = local_rope(config, layer)
        spec = config.attention
        self.scale = None if spec.scalar is None else spec.scalar**-0.5
        self.impl = impl
        self.recompute = recompute  # recompute the attention core in backward (selective recompute)
        self.fused = fast.projections  # q/k/v as one matmul
        self.q_proj = nn.Linear(hidden, config.num_heads * hd, bias=spec.bias)
        self.k_proj = nn.Linear(hidden, config.num_kv_heads * hd, bias=spec.bias)
        self.v_proj = nn.Linear(hidden, config.num_kv_heads * hd, bias=spec.bias)
        self.o_proj = nn.Linear(config.num_heads * hd, hidden, bias=spec.out_bias)
        self.gate_proj = (
            nn.Linear(hidden, config.num_heads * hd, bias=spec.bias) if spec.output_gate else None
        )
        # qk_norm (Qwen 3, Gemma 3): one RMSNorm weight for every q head and one for every k head;
        # acting per head, it needs no change when a tensor-parallel shard holds only some heads.
        self.q_norm = make_norm(config, fast, hd) if spec.qk_norm else None
        self.k_norm = make_norm(config, fast, hd) if spec.qk_norm else None
        self.sinks = HeadWeights(config.num_heads) if spec.sinks else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        segments: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        # Local head counts come from the projections (a TP shard holds heads/tp of them).
        # generating (a cache): a few tokens, for which concatenating the weights costs more than it saves
        linears = [self.q_proj, self.k_proj, self.v_proj] + (
            [self.gate_proj] if self.gate_proj is not None else []
        )
        projected = project(x, *linears, fused=self.fused and cache is None)
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in projected[:3])
        gate = projected[3] if self.gate_proj is not None else None
        if self.q_norm is not None:  # before RoPE, as Qwen 3 and Gemma 3 normalise
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        sinks = None if self.sinks is None else self.sinks()
        if cache is not None:  # the new tokens' queries over every key so far
            k, v = cache.update(self.layer, k, v)
            out = suffix_attention(q, k, v, self.window, self.impl, segments, cache.keys, self.scale, sinks)
            return self._output(out, gate)
        args = (q, k, v, self.window, self.impl, segments, self.scale, sinks)
        if self.recompute and torch.is_grad_enabled():  # selective: keep q, k, v, not the kernel's saves
            out = checkpoint(self.kernel, *args, use_reentrant=False)
        else:
            out = self.kernel(*args)
        return self._output(out, gate)

    def _output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The output projection of the heads' output [B, S, heads, D], gated (`output_gate`)."""
        out = out.flatten(2)
        return self.o_proj(out if gate is None else out * torch.sigmoid(gate))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE over the first `rotary` dims of each head, the rest passed through (partial rotary)."""
        if self.rotary == self.head_dim:
            return apply_rope(x, cos, sin)
        return torch.cat([apply_rope(x[..., : self.rotary], cos, sin), x[..., self.rotary :]], dim=-1)


LATENT_NORM_EPS = 1e-6  # DeepSeek's latent norms' own (transformers' DeepseekV3RMSNorm default)


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek V2/V3, `families/deepseek_v3.py`): q through one
    projection or a low-rank one, its RMSNorm and an expansion per head; k's and v's per-head parts
    expanded from one normed latent (`kv_b_proj`), and a rotated part every head shares appended to
    each head's k. q's and k's heads are head_dim wide (the rotated `qk_rope_head_dim` last), v's
    `v_head_dim`. A tensor-parallel shard holds some heads of q_proj / q_b_proj, kv_b_proj and o_proj;
    the latent projections and norms are whole on every rank (the heads need all of them).

    Context parallel (`megacore.parallel.cp`) sets `kernel` to one that takes the whole row's k and
    v, and `whole_row` to the gather of the normed latent and the rotated k: those travel (latent +
    rope wide a token), and each rank expands the whole row's k and v from them."""

    kernel = staticmethod(causal_attention)
    whole_row: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(
        self,
        config: ModelConfig,
        layer: int = 0,
        impl: Impl = "auto",
        recompute: bool = False,
        fast: FastPaths = FastPaths(),
    ) -> None:
        super().__init__()
        hidden, heads, hd = config.hidden_size, config.num_heads, config.head_dim
        self.layer = layer
        la = config.latent
        self.rope, self.v_dim, self.latent = la.qk_rope_head_dim, la.v_head_dim, la.kv_lora_rank
        self.nope = hd - self.rope
        self.window = attention_window(config, layer)
        self.local_rope = local_rope(config, layer)
        self.scale = latent_attention_scale(config)
        self.impl = impl
        self.recompute = recompute
        q_lora, norm = la.q_lora_rank, partial(RMSNorm, eps=LATENT_NORM_EPS, fused=fast.head_norms)
        self.q_proj = nn.Linear(hidden, heads * hd, bias=False) if q_lora is None else None
        self.q_a_proj = nn.Linear(hidden, q_lora, bias=False) if q_lora else None
        self.q_a_norm = norm(q_lora) if q_lora else None
        self.q_b_proj = nn.Linear(q_lora, heads * hd, bias=False) if q_lora else None
        self.kv_a_proj = nn.Linear(hidden, self.latent + self.rope, bias=False)
        self.kv_a_norm = norm(self.latent)
        self.kv_b_proj = nn.Linear(self.latent, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=False)
        # The rotated k every head shares: an identity here; where a rank holds some heads (tensor
        # parallel) its gradient is the sum over every rank's heads, which `tp.apply_tp` hooks in.
        self.shared_rope = nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        segments: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(b, s, -1, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj(x).split([self.latent, self.rope], dim=-1)
        latent = self.kv_a_norm(latent)
        k_rope = self.shared_rope(apply_rope(k_rope.view(b, s, 1, self.rope), cos, sin))
        if self.whole_row is not None:  # context parallel: the whole row's, in one gather
            whole = self.whole_row(torch.cat([latent, k_rope.view(b, s, self.rope)], dim=-1))
            latent, k_rope = whole.split([self.latent, self.rope], dim=-1)
            k_rope = k_rope.unsqueeze(2)
        if cache is not None:  # the latent and rotated k so far: k and v expanded from them below
            latent, k_rope = cache.update(self.layer, latent, k_rope)
        kv = self.kv_b_proj(latent).view(b, latent.shape[1], -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        # v's heads padded with zeros to q's width: SDPA's fused kernels take only equal widths
        # (unequal ones fall to its math path, 2-3x slower on a CPU), and the zeros add nothing.
        wide = F.pad(v, (0, q.shape[-1] - self.v_dim)) if self.v_dim < q.shape[-1] else v
        if cache is not None:
            out = suffix_attention(q, k, wide, self.window, self.impl, segments, cache.keys, self.scale)
            return self.o_proj(out[..., : self.v_dim].reshape(b, s, -1))
        args = (q, k, wide, self.window, self.impl, segments, self.scale)
        if self.recompute and torch.is_grad_enabled():
            out = checkpoint(self.kernel, *args, use_reentrant=False)
        else:
            out = self.kernel(*args)
        return self.o_proj(out[..., : self.v_dim].reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU, GeGLU or clamped SwiGLU (gate, up, down; `GATED_ACTIVATIONS`, `moe.GLU`) or GELU
    (up, down, as Falcon), `ffn` wide (None: the config's ffn_hidden_size)."""

    def __init__(self, config: ModelConfig, fast: FastPaths = FastPaths(), ffn: int | None = None) -> None:
        super().__init__()
        self.fused = fast.projections  # gate/up as one matmul
        hidden, bias = config.hidden_size, config.mlp_bias
        ffn = config.ffn_hidden_size if ffn is None else ffn
        gated = config.activation in GATED_ACTIVATIONS
        self.gate_proj = nn.Linear(hidden, ffn, bias=bias) if gated else None
        self.up_proj = nn.Linear(hidden, ffn, bias=bias)
        self.down_proj = nn.Linear(ffn, hidden, bias=bias)
        self.glu = GLU.of(config)

    def forward(self, x: torch.Tensor, fused: bool = True) -> torch.Tensor:
        """`fused` False: gate and up apart whatever the build chose (a few tokens, generating)."""
        if self.gate_proj is not None:
            gate, up = project(x, self.gate_proj, self.up_proj, fused=self.fused and fused)
            return self.down_proj(self.glu(gate, up))
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    """Pre-norm block; sequential (x + attn, then + mlp) or parallel (x + attn(n1 x) + mlp(n2 x));
    with `sandwich_norm` (Gemma) the attention's and the MLP's outputs are normed again before
    each is added."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int = 0,
        attention: Impl = "auto",
        recompute: str = "none",
        fast: FastPaths = FastPaths(),
    ) -> None:
        super().__init__()
        self.parallel = config.block.parallel
        # full: keep only the block's input for backward and run it again there
        self.recompute = recompute == "full"
        # Registered in the naming contract's order (`model_tensors`).
        self.attn_norm = make_norm(config, fast)
        kind = Attention if config.latent is None else LatentAttention
        kind = GatedDeltaNet if linear_layer(config, layer) else kind
        self.attn = kind(config, layer, attention, recompute == "selective", fast)
        self.attn_post_norm = make_norm(config, fast) if config.block.sandwich_norm else None
        self.mlp_norm = make_norm(config, fast) if config.block.mlp_norm else None
        if sparse_layer(config, layer):
            shared = config.moe.shared_expert
            self.mlp = MoE(config, None if shared is None else MLP(config, fast, shared.size))
        else:
            self.mlp = MLP(config, fast, mlp_width(config, layer))
        self.mlp_post_norm = make_norm(config, fast) if config.block.sandwich_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        segments: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, segments, cache, use_reentrant=False)
        return self._forward(x, cos, sin, segments, cache)

    def _forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        segments: torch.Tensor | None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        h = self.attn_norm(x)
        # segments by keyword: tensor-parallel input styles describe the positional inputs only
        a = self.attn(h, cos, sin, segments=segments, cache=cache)
        if self.parallel:
            m = self._mlp(h if self.mlp_norm is None else self.mlp_norm(x), cache)
            return x + (m + a)
        if self.attn_post_norm is not None:
            a = self.attn_post_norm(a)
        x = x + a
        m = self._mlp(self.mlp_norm(x), cache)
        if self.mlp_post_norm is not None:
            m = self.mlp_post_norm(m)
        return x + m

    def _mlp(self, x: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        if cache is not None and isinstance(self.mlp, MLP):  # generating: its projections apart
            return self.mlp(x, fused=False)
        return self.mlp(x)


class Decoder(nn.Module):
    """Decoder-only transformer. `layers` chooses which global layers this module holds (a pipeline
    stage); `embed=False` / `head=False` leave out the embedding / final norm and output projection.
    Tied embeddings: the logits use the embedding's weight, or on a stage without the embedding an
    `lm_head` of its own that the caller keeps equal to it (`model_tensors`). `attention`: the
    kernel, 'auto' (flash-attn on GPU when installed, else SDPA), 'sdpa' or 'flash'; `recompute`:
    activation recompute, 'none', 'selective' (the attention core) or 'full' (each block);
    `fast`: the single-device fast paths it takes."""

    # The ranks a sequence is spread over (context parallel: `megacore.parallel.cp` sets it): x
    # holds 1 / sequence_shards of each row, and RoPE's tables are those of the whole row's length.
    sequence_shards = 1

    def __init__(
        self,
        config: ModelConfig,
        layers: Iterable[int] | None = None,
        embed: bool = True,
        head: bool = True,
        *,
        attention: Impl = "auto",
        recompute: str = "none",
        fast: FastPaths = FastPaths(),
    ) -> None:
        super().__init__()
        self.config = config
        vocab = config.padded_vocab_size
        self.embed = nn.Embedding(vocab, config.hidden_size) if embed else None
        indices = range(config.num_layers) if layers is None else layers
        self.layers = nn.ModuleDict({str(i): Block(config, i, attention, recompute, fast) for i in indices})
        self.norm = make_norm(config, fast) if head else None
        self.lm_head = (
            nn.Linear(config.hidden_size, vocab, bias=False)
            if head and not (config.tie_embeddings and embed)
            else None
        )

    def forward(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        reduction: Literal["mean", "sum", "rows"] = "mean",
        segments: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Token ids [B, S] -> logits [B, S, padded_vocab] (or hidden states in/out on inner stages).

        With `targets` [B, S] (last stage only) returns the next-token cross entropy over the
        targets that are not IGNORE instead (their mean, sum, or each row's sum), fused with the
        output projection (never full fp32 logits; plain tensors only: tensor-parallel weights give
        logits, whose loss the caller computes). `positions` [B, S] packs several documents in a row: each counts
        its positions from 0, and attends only within itself (HF's packing convention). A part of
        each row (context parallel) comes with its tokens' `positions` and document ids
        (`segments`, None: one document), which a part cannot work out by itself. With a `cache`
        (`models.kv_cache`), x holds the rows' next tokens, after what the cache holds of them, and
        the logits are the last position's only [B, 1, vocab]."""
        if cache is not None:
            return self._cached(x, cache)
        x = self._embed(x)
        tables = self._tables(x.shape[1] * self.sequence_shards, x, positions)
        if segments is None and positions is not None and self.sequence_shards == 1:
            segments = document_ids(positions)
        for block in self.layers.values():
            x = block(x, *tables[block.attn.local_rope], segments)
        if self.norm is None:
            if targets is not None:
                raise RuntimeError("targets given to a stage without the output head")
            return x
        x = self.norm(x)
        if targets is None:
            return self._logits(x)
        weight = self.lm_head.weight if self.lm_head is not None else self.embed.weight
        return fused_linear_cross_entropy(x, weight, targets, self.config.vocab_size, reduction)

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids to hidden states on the first stage (Gemma's scaled); a later stage's input as it is."""
        if self.embed is None:
            return x
        x = self.embed(x)
        return x * embed_scale(self.config, x.dtype) if self.config.scale_embeddings else x

    def _tables(
        self, seq_len: int, x: torch.Tensor, positions: torch.Tensor | None
    ) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """The RoPE tables once per forward, by whether local (Gemma 3's local layers have their own)."""
        return {
            local: rope_tables(self.config, seq_len, x.device, x.dtype, positions, local=local)
            for local in {block.attn.local_rope for block in self.layers.values()}
        }

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output projection of normed hidden states: through the module where there is one
        (tensor-parallel styles hook lm_head), else the tied embedding's weight."""
        return self.lm_head(x) if self.lm_head is not None else F.linear(x, self.embed.weight)

    def _cached(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The logits [B, 1, vocab] of the token after x's [B, s] (ids, or an earlier pipeline
        stage's hidden states), each row's after what `cache` holds of it; the stage's layers' cache
        then holds them too, and the caller advances it once every stage has run
        (`models.sampling.decode`). A stage without the head returns its hidden states [B, s, h]."""
        b, s = x.shape[:2]
        segments = cache.start(s)
        h = self._embed(x)
        # the whole length so far: what dynamic RoPE scaling measures growth by
        tables = self._tables(cache.length + s, h, cache.positions(s, b, x.device))
        for block in self.layers.values():
            h = block(h, *tables[block.attn.local_rope], segments, cache)
        if self.norm is None:
            return h
        return self._logits(self.norm(h[:, -1:]))  # the next token's only: the prompt's are never read

    def compile_blocks(self) -> None:
        """torch.compile each block in place, as torchtitan does: blocks share code and shapes, so one
        compiled graph (forward and backward) serves every layer and compile time stays that of one
        block. Norms and RoPE then run as plain ops that the compiler fuses with their neighbours."""
        for block in self.layers.values():
            block.compile(dynamic=False)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int = 0) -> None:
        """Fresh-training init (works after `to_empty` from the meta device): `initial_value` for
        every parameter."""
        for name, p in self.named_parameters():
            p.copy_(initial_value(name, tuple(p.shape), self.config, std, seed))


def embed_scale(config: ModelConfig, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) as transformers' Gemma scales its embeddings: a float32 tensor cast to the
    activations' dtype (sqrt(3072) = 55.4256 becomes 55.5 in bf16), returned as the Python float
    of that value so a multiply rounds as HF's tensor product does (and takes a DTensor)."""
    return float(torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(dtype))


def initial_value(
    name: str, shape: tuple[int, ...], config: ModelConfig, std: float = 0.02, seed: int = 0
) -> torch.Tensor:
    """The fresh fp32 value of parameter `name` (a contract name): normal(0, std) matrices and
    embeddings, zero biases and sinks, unit norm scales (weights of 0 for rmsnorm_plus1's 1 + weight), zero
    padded-vocab rows; a LoRA adapter as PEFT starts one: B zero, A Kaiming-uniform (a = sqrt(5):
    uniform within 1 / sqrt(in)), as PyTorch's Conv1d starts linear attention's filters; its
    per-head output norm and dt_bias ones whatever the norm kind, its decay rates exp(a_log)
    uniform in [1, 16] (transformers' Qwen 3.5 init, without the rates below 1 that keep its
    state for long). Drawn from a generator seeded by `seed` and the name, so every layout (each
    rank slicing what it holds) gets the same model."""
    if name.endswith((LORA_B, ".bias", ".sinks.weight")):  # biases: experts' are [experts, out]
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith(".attn.a_log.weight"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log_()
    if name.endswith((".attn.dt_bias.weight", ".attn.norm.weight")):
        return torch.ones(shape)
    if len(shape) == 1:
        zero = name.endswith("router_bias") or isinstance(config.norm, PlusOneRMSNormSpec)
        return torch.zeros(shape) if zero else torch.ones(shape)
    if name.endswith((LORA_A, "_conv.weight")):
        bound = 1.0 / math.sqrt(math.prod(shape[1:]))  # 1 / sqrt(fan in)
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)
    value = torch.empty(shape).normal_(0.0, std, generator=gen)
    if name in ("embed.weight", "lm_head.weight"):
        value[config.vocab_size :] = 0
    return value
