"""Packed documents (`positions` restarting at 0 per document): each document's loss and
gradients equal those of the same document run on its own (fp32, within REL), for every attention
path that runs on CPU (SDPA with a block-causal mask, a sliding window shorter than the documents,
selective and full recompute, Qwen 3's per-head q/k norms, Gemma 3's local and global layers,
Qwen 3.5's linear attention, whose convolution and state restart at each document)."""

from __future__ import annotations

import copy

import pytest
import torch

from megacore.config import ModelConfig
from megacore.config_parts import (
    GatedDeltaNetSpec,
    PlusOneRMSNormSpec,
    RopeSpec,
    SequentialBlockSpec,
    StandardAttentionSpec,
)
from megacore.models import Decoder
from megacore.models.attention import document_mask
from megacore.models.loss import IGNORE

BASE = dict(
    family="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
    ffn_hidden_size=64, max_seq_len=64,
)  # fmt: skip
# Gemma 3: a local layer (window 4, shorter than most documents, its own RoPE base) and a global one,
# (1 + w) norms (four per block, and on q/k heads), scaled embeddings, tanh GeGLU, its score scale.
GEMMA3 = dict(
    family="gemma3", norm=PlusOneRMSNormSpec(), activation="geglu_tanh", head_dim=16,
    attention=StandardAttentionSpec(qk_norm=True, scalar=12.0), block=SequentialBlockSpec(sandwich_norm=True),
    scale_embeddings=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
    rope=RopeSpec(local_theta=100.0), tie_embeddings=True,
)  # fmt: skip
# Qwen 3.5: a Gated DeltaNet layer (2 key heads, 4 value heads) and a full one with its output gate.
QWEN35 = dict(
    family="qwen3_5", norm=PlusOneRMSNormSpec(), head_dim=16, rope=RopeSpec(partial_rotary_factor=0.25),
    attention=StandardAttentionSpec(qk_norm=True, output_gate=True),
    linear_attention=GatedDeltaNetSpec(key_heads=2, value_heads=4, key_head_dim=8, value_head_dim=8),
    layer_types=["linear_attention", "full_attention"],
)  # fmt: skip
REL = 1e-5  # fp32: the packed and the separate runs round differently (batched, masked kernels)
LENGTHS = [(7, 12, 5), (24,), (3, 3, 9, 9)]  # documents per row; every row is 24 tokens


def model(recompute: str = "none", **overrides) -> Decoder:
    m = Decoder(ModelConfig(**{**BASE, **overrides}), attention="sdpa", recompute=recompute)
    m.init_weights(std=0.2, seed=1)
    return m


def packed_rows(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, list[list[torch.Tensor]]]:
    """Tokens [3, 24] and positions of the packed rows, and each row's documents (seq + 1 tokens each:
    the last token is the target of the one before it)."""
    docs = [[torch.randint(0, BASE["vocab_size"], (n + 1,), generator=g) for n in row] for row in LENGTHS]
    tokens = torch.stack([torch.cat([d[:-1] for d in row]) for row in docs])
    positions = torch.stack([torch.cat([torch.arange(len(d) - 1) for d in row]) for row in docs])
    return tokens, positions, docs


@pytest.mark.parametrize(
    "overrides, recompute",
    [
        ({}, "none"),
        ({}, "selective"),
        ({}, "full"),
        ({"family": "mistral", "sliding_window": 4}, "none"),
        *[({"family": "qwen3", "attention": StandardAttentionSpec(qk_norm=True), "head_dim": 16}, mode) for mode in ("selective", "full")],
        *[(GEMMA3, mode) for mode in ("selective", "full")],
        (QWEN35, "none"),
    ],
    ids=["llama", "selective", "full", "mistral-window-4", "qwen3-selective", "qwen3-full",
         "gemma3-selective", "gemma3-full", "qwen3.5"],
)  # fmt: skip
def test_packed_documents_match_each_document_alone(overrides: dict, recompute: str) -> None:
    g = torch.Generator().manual_seed(0)
    m = model(recompute, **overrides)
    alone = copy.deepcopy(m)
    tokens, positions, docs = packed_rows(g)
    # Summed loss over each document's own targets; the token after a document is not its target.
    targets = torch.stack([torch.cat([d[1:] for d in row]) for row in docs])
    loss = m(tokens, targets, positions=positions)  # mean over every target (none ignored)
    loss.backward()

    want_sum = 0.0
    for row in docs:
        for d in row:
            part = alone(d[None, :-1], d[None, 1:])  # this document's mean loss, alone
            (part * (len(d) - 1) / tokens.numel()).backward()
            want_sum += part.item() * (len(d) - 1)
    assert abs(loss.item() - want_sum / tokens.numel()) < REL * want_sum / tokens.numel()
    for (name, p), q in zip(m.named_parameters(), alone.parameters(), strict=True):
        assert (p.grad - q.grad).norm() <= REL * q.grad.norm(), name


def test_positions_and_ignored_targets_give_each_document_its_own_logits() -> None:
    """Logits per packed document equal the document's logits alone; a target of IGNORE between
    documents (pretraining with document masking) leaves the loss of the others unchanged."""
    g = torch.Generator().manual_seed(1)
    m = model()
    tokens, positions, docs = packed_rows(g)
    logits = m(tokens, positions=positions)
    for r, row in enumerate(docs):
        start = 0
        for d in row:
            n = len(d) - 1
            torch.testing.assert_close(logits[r, start : start + n], m(d[None, :-1])[0], rtol=REL, atol=1e-5)
            start += n
    # Next-token targets over the whole row; each document's last target crosses into the next one.
    flat = torch.cat([torch.cat([d[:-1] for d in row] + [row[-1][-1:]]) for row in docs]).view(3, 25)
    targets = flat[:, 1:].clone()
    targets[:, :-1][positions[:, 1:] == 0] = IGNORE
    kept = targets != IGNORE
    want = torch.nn.functional.cross_entropy(logits[kept][:, : BASE["vocab_size"]], targets[kept])
    assert abs(m(tokens, targets, positions=positions).item() - want.item()) < REL * want.item()


def test_document_mask_is_block_causal_with_window() -> None:
    segments = torch.tensor([[1, 1, 1, 2, 2]])
    want = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]],
        dtype=torch.bool,
    )
    assert torch.equal(document_mask(segments, window=2)[0, 0], want)
    assert torch.equal(document_mask(segments)[0, 0, 2], torch.tensor([True, True, True, False, False]))
