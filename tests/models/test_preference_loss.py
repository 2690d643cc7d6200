"""The preference objectives against their papers' formulas, written out here with `math` on
floats, and the fused loss's per-row sums against F.cross_entropy."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megacore.models.loss import fused_linear_cross_entropy
from megacore.models.preference import METRICS, Preference, pair_losses, pair_metrics

# Two pairs: rows chosen, rejected, chosen, rejected.
LOGPS = [-12.5, -15.0, -30.25, -28.0]
LENGTHS = [5, 6, 12, 9]
REF = [-13.0, -14.0, -29.0, -29.5]


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def expected(obj: Preference) -> tuple[list[float], list[list[float]]]:
    """Per pair: the loss, and (reward chosen, reward rejected, logp chosen, logp rejected)."""
    losses, stats = [], []
    b = obj.beta
    for k in range(2):
        pc, pr, rc, rr = LOGPS[2 * k], LOGPS[2 * k + 1], REF[2 * k], REF[2 * k + 1]
        nc, nr = LENGTHS[2 * k], LENGTHS[2 * k + 1]
        if obj.type == "dpo":
            h = math.log(math.exp(pc) / math.exp(rc)) - math.log(math.exp(pr) / math.exp(rr))
            if obj.loss == "ipo":
                losses.append((h - 1 / (2 * b)) ** 2)
            else:
                e = obj.label_smoothing
                losses.append(-(1 - e) * log_sigmoid(b * h) - e * log_sigmoid(-b * h))
            stats.append([b * (pc - rc), b * (pr - rr), pc, pr])
            continue
        ac, ar = pc / nc, pr / nr
        if obj.type == "simpo":
            losses.append(-log_sigmoid(b / nc * pc - b / nr * pr - obj.gamma))
        else:  # ORPO: odds(y) = P / (1 - P) with P the per-token geometric mean probability
            p_c, p_r = math.exp(ac), math.exp(ar)
            ratio = math.log((p_c / (1 - p_c)) / (p_r / (1 - p_r)))
            losses.append(-ac - b * log_sigmoid(ratio))
        stats.append([b * ac, b * ar, ac, ar])
    return losses, stats


OBJECTIVES = [
    Preference("dpo", beta=0.1),
    Preference("dpo", beta=0.5, label_smoothing=0.2),
    Preference("dpo", beta=0.1, loss="ipo"),
    Preference("simpo", beta=2.0, gamma=0.5),
    Preference("orpo", beta=0.1),
]


@pytest.mark.parametrize("obj", OBJECTIVES, ids=lambda o: f"{o.type}-{o.loss}-{o.label_smoothing}")
def test_losses_and_metrics_match_the_papers(obj: Preference) -> None:
    logps = torch.tensor(LOGPS, dtype=torch.float64)
    loss, stats = pair_losses(obj, logps, torch.tensor(LENGTHS), torch.tensor(REF, dtype=torch.float64))
    want_loss, want_stats = expected(obj)
    torch.testing.assert_close(loss, torch.tensor(want_loss, dtype=torch.float64), rtol=1e-12, atol=0)
    torch.testing.assert_close(stats, torch.tensor(want_stats, dtype=torch.float64), rtol=1e-12, atol=0)
    sums = pair_metrics(stats)
    chosen, rejected = [s[0] for s in want_stats], [s[1] for s in want_stats]
    want = {
        "rewards/chosen": sum(chosen),
        "rewards/rejected": sum(rejected),
        "rewards/accuracies": sum(c > r for c, r in zip(chosen, rejected, strict=True)),
        "rewards/margins": sum(c - r for c, r in zip(chosen, rejected, strict=True)),
        "logps/chosen": sum(s[2] for s in want_stats),
        "logps/rejected": sum(s[3] for s in want_stats),
    }
    assert dict(zip(METRICS, sums.tolist(), strict=True)) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("obj", OBJECTIVES, ids=lambda o: f"{o.type}-{o.loss}-{o.label_smoothing}")
def test_empty_slots_of_packed_rows_count_for_nothing(obj: Preference) -> None:
    """Two pairs with an empty slot (no tokens, sums 0) before and after the second: the papers'
    losses and statistics of the two, zeros for the empty slot, and its gradient 0, not NaN."""
    logps = torch.tensor([*LOGPS[:2], 0.0, 0.0, *LOGPS[2:], 0.0, 0.0], dtype=torch.float64)
    logps.requires_grad_(True)
    lengths = torch.tensor([*LENGTHS[:2], 0, 0, *LENGTHS[2:], 0, 0])
    ref = torch.tensor([*REF[:2], 0.0, 0.0, *REF[2:], 0.0, 0.0], dtype=torch.float64)
    loss, stats = pair_losses(obj, logps, lengths, ref)
    want_loss, want_stats = expected(obj)
    zeros = [0.0] * 4
    torch.testing.assert_close(
        loss.detach(),
        torch.tensor([want_loss[0], 0, want_loss[1], 0], dtype=torch.float64),
        rtol=1e-12,
        atol=0,
    )
    torch.testing.assert_close(
        stats,
        torch.tensor([want_stats[0], zeros, want_stats[1], zeros], dtype=torch.float64),
        rtol=1e-12,
        atol=0,
    )
    assert pair_metrics(stats)[2].item() == sum(c > r for c, r, *_ in want_stats)  # accuracies
    loss.sum().backward()
    assert torch.isfinite(logps.grad).all()
    assert logps.grad[[2, 3, 6, 7]].tolist() == [0.0] * 4 and logps.grad[0].item() != 0


def test_dpo_gradient_is_the_closed_form() -> None:
    """d/dπ_c of -log σ(β h) is -β σ(-β h) (and +β σ(-β h) for π_r)."""
    logps = torch.tensor(LOGPS, dtype=torch.float64, requires_grad=True)
    loss, _ = pair_losses(
        Preference("dpo", beta=0.3), logps, torch.tensor(LENGTHS), torch.tensor(REF, dtype=torch.float64)
    )
    loss.sum().backward()
    for k in range(2):
        h = (LOGPS[2 * k] - REF[2 * k]) - (LOGPS[2 * k + 1] - REF[2 * k + 1])
        g = 0.3 / (1 + math.exp(0.3 * h))
        assert logps.grad[2 * k].item() == pytest.approx(-g, rel=1e-12)
        assert logps.grad[2 * k + 1].item() == pytest.approx(g, rel=1e-12)


def test_dpo_without_a_reference_is_refused() -> None:
    with pytest.raises(ValueError, match="reference"):
        pair_losses(Preference("dpo"), torch.zeros(2), torch.ones(2))


def test_fused_row_sums_equal_cross_entropy_per_row() -> None:
    """fp32, as the fused loss computes (its scratch and sums are fp32)."""
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    targets = torch.randint(0, 37, (3, 7))
    targets[0, :3] = -100
    targets[2, 5:] = -100
    rows = fused_linear_cross_entropy(hidden, weight, targets, 37, reduction="rows")
    logits = (hidden @ weight.T)[..., :37]
    want = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").sum(1)
    torch.testing.assert_close(rows, want, rtol=1e-5, atol=1e-5)
    coef = torch.tensor([1.0, -2.0, 0.5])
    got = torch.autograd.grad((rows * coef).sum(), (hidden, weight))
    ref = torch.autograd.grad((want * coef).sum(), (hidden, weight))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
