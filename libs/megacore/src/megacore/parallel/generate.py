"""Greedy generation and scoring with a `ParallelModel` in any layout (samples while training,
lm-evaluation-harness).

Every rank runs the same rows: the layout splits the model's work, not the rows, so every rank
takes part in the same collectives. The ranks that hold the whole vocab's logits
(`ParallelModel.reports_logits`) work out the next tokens or the log-probabilities, and one
broadcast from the first of them hands every rank the result, so that all go on alike. Greedy
completions run on the sampler with its KV cache (`parallel.sampler`) in the layouts it runs in;
in the others (cp, sequence parallel, compiled blocks, fp8) each new token is a forward
over the rows so far (`ParallelModel.logits`), rows of different lengths padded on the right,
which changes no logit a row reads: a step costs a whole forward there.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megacore.parallel.engine import ParallelModel
from megacore.parallel.sampler import runs_sampler, sample_parallel


class Generator:
    """Greedy completions (`greedy`) and continuations' log-probabilities (`score`) from `pm`; a
    collective: every rank calls each with the same rows."""

    def __init__(self, pm: ParallelModel) -> None:
        self.pm = pm
        # The first rank that holds the logits broadcasts what they give.
        me = torch.tensor([dist.get_rank() if pm.reports_logits else dist.get_world_size()], device=pm.device)
        dist.all_reduce(me, op=dist.ReduceOp.MIN)
        self.src = int(me.item())

    def _logits(self, rows: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """The rows' logits [n, longest, vocab] (right-padded with id 0) where they are held."""
        longest = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        return self.pm.logits(ids.to(self.pm.device))

    def _share(self, t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """`t` from the first logits rank, on every rank, on the host."""
        out = t.to(self.pm.device, dtype) if t is not None and dist.get_rank() == self.src else None
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=self.pm.device)
        dist.broadcast(out, src=self.src)
        return out.cpu()

    def greedy(
        self,
        prompts: Sequence[Sequence[int]],
        max_new: int,
        stop_ids: Collection[int] = (),
        done: Callable[[int, list[int]], bool] | None = None,
    ) -> list[list[int]]:
        """Each prompt's greedy continuation: up to `max_new` ids, ending after a stop id or when
        `done(row, ids so far)` says so. The sampler with its KV cache where the layout runs it."""
        if runs_sampler(self.pm.par):
            return sample_parallel(self.pm, prompts, max_new, stop_ids=stop_ids, done=done)
        rows = [list(p) for p in prompts]
        out: list[list[int]] = [[] for _ in rows]
        live = list(range(len(rows)))
        for _ in range(max_new):
            if not live:
                break
            logits = self._logits([rows[i] for i in live])
            nxt = None
            if logits is not None:
                ends = torch.tensor([len(rows[i]) - 1 for i in live], device=logits.device)
                nxt = logits[torch.arange(len(live), device=logits.device), ends].argmax(-1)
            nxt = self._share(nxt, (len(live),), torch.long).tolist()
            for i, tok in zip(list(live), nxt, strict=True):
                rows[i].append(tok)
                out[i].append(tok)
                if tok in stop_ids or (done is not None and done(i, out[i])):
                    live.remove(i)
        return out

    def score(self, rows: Sequence[tuple[Sequence[int], int]]) -> list[tuple[float, bool]]:
        """For rows of ids whose last `n` are a continuation, (`ids`, `n`): the continuation's
        summed log-probability given what precedes it, and whether greedy decoding gives it."""
        inputs = [list(ids[:-1]) for ids, _ in rows]
        logits = self._logits(inputs)
        result = None
        if logits is not None:
            logps = F.log_softmax(logits, dim=-1)
            result = torch.zeros(len(rows), 2, dtype=torch.float64)
            for i, (ids, n) in enumerate(rows):
                end = len(ids) - 1
                cont = torch.tensor(ids[-n:], device=logps.device)
                part = logps[i, end - n : end]
                result[i, 0] = part.gather(-1, cont[:, None]).sum().double()
                result[i, 1] = float(bool((part.argmax(-1) == cont).all()))
        shared = self._share(result, (len(rows), 2), torch.float64)
        return [(float(a), bool(b)) for a, b in shared.tolist()]
