"""A loss over each sequence's summed log-probability instead of its tokens' cross entropy.

Preference objectives (and later, online RL) compare whole sequences: what they need of a row is the
summed log-probability of its counted targets. A row holds one sequence, or with packed pairs
several (`slots`: the most a row holds, each told apart by its positions restarting at 0). `RowSums`
hands its function, per microbatch, (logps [b x slots], counted targets [b x slots], the
microbatch's number): each row's slots in turn (an empty slot counts none); the function returns the
microbatch's summed loss, and the step's mean divides by the pairs among the rows (chosen sides,
slots 0, 2, ..., that count a target). Under cp each rank holds part of every row: the parts' sums
are added over cp, and the gradient flows back to this rank's part alone (each rank's backward then
gives its part's gradient, as with language modelling). A microbatch's number may come twice:
torch's pipeline schedules infer their backward's shapes from a first loss of microbatch 0 (torch
2.13), so a second call replaces the first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from megacore.data.packing import IGNORE
from megacore.models.attention import document_ids
from megacore.parallel.cp import shard_sequence
from megacore.parallel.losses import Loss, Microbatch

RowsFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


class RowSums(Loss):
    """`fn` over each side's summed log-probability of its counted targets (module docstring)."""

    per_token = False
    fused = "rows"

    def __init__(
        self,
        fn: RowsFn,
        vocab_size: int,
        tp_mesh: DeviceMesh | None,
        cp_mesh: DeviceMesh | None,
        slots: int = 1,
    ) -> None:
        super().__init__(vocab_size, tp_mesh)
        self.fn, self.cp_mesh, self.slots = fn, cp_mesh, slots

    def count(self, targets: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Where each target of whole rows [B, S] is summed: its side's slot, the side's number in
        its row (document ids from `positions`; `slots` past the last, padding's), kept as this
        rank's part of the rows (cp); each slot's counted targets [B, slots]. Returns the pairs
        among the rows: chosen sides that count a target."""
        m = self.slots
        sides = torch.zeros_like(targets) if positions is None else document_ids(positions) - 1
        slots = sides.clamp(max=m)
        counted = targets.new_zeros(targets.shape[0], m + 1)
        self._counted = counted.scatter_add_(1, slots, (targets != IGNORE).long())[:, :m]
        if self.cp_mesh is not None:
            slots = shard_sequence(slots, self.cp_mesh.size(), self.cp_mesh.get_local_rank())
        self._slots = slots
        return (self._counted.reshape(-1)[0::2] > 0).sum()

    def of_fused(self, mb: Microbatch, value: torch.Tensor) -> torch.Tensor:
        return self.fn(*self._rows(-value, mb))  # the fused head's rows: each row's summed NLL

    def of_logits(self, mb: Microbatch, logits: torch.Tensor) -> torch.Tensor:
        return self.fn(*self._rows(self.token_logps(logits, mb.targets), mb))

    def _rows(self, logps: torch.Tensor, mb: Microbatch) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`fn`'s inputs for a microbatch: each side's summed log-probability and counted targets,
        [b x slots] each, from its targets' log-probabilities [b, s] (or, one side per row, their
        rows' sums [b]), and its number."""
        i, b, m = mb.index, mb.targets.shape[0], self.slots
        rows = slice(i * b, (i + 1) * b)
        if logps.dim() == 2:
            logps = logps.new_zeros(b, m + 1).scatter_add(1, self._slots[rows], logps)[:, :m]
        logps, counted = logps.reshape(-1), self._counted[rows].reshape(-1)
        if self.cp_mesh is None:
            return logps, counted, i
        whole = logps.detach().clone()
        dist.all_reduce(whole, group=self.cp_mesh.get_group())
        return logps + (whole - logps.detach()), counted, i
