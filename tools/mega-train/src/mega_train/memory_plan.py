"""The dry run's memory plan: a checked run's per-rank bytes and, for a number of GPUs, the layouts
that fit and the longest sequence each fits, as JSON-able data and as text. The arithmetic is
`megacore.planner` (no torch)."""

from __future__ import annotations

import dataclasses

from mega_train.objectives import kind_of
from mega_train.run_plan import RunPlan
from megacore import planner
from megacore.parallel.layout import RECOMPUTE

COLUMNS = ("weights", "grads", "optimizer", "copies", "activations", "buffers", "total")
TOP = 5  # layouts printed (the JSON has them all)
LONGEST_TOP = 3  # layouts printed by the longest sequence they fit


def memory_plan(plan: RunPlan, gpu_memory: int | None = None, gpus: int | None = None) -> dict:
    """The run's per-rank memory and, with `gpus`, every layout of that many GPUs (best first)."""
    run, config = plan.run, plan.config
    par = plan.parallelism
    micro, seq = run.batch.micro_batch_size * plan.rows_per_sample, run.batch.seq_length  # rows
    rows = planner.estimate(config, par, plan.dp, micro, seq, run.attention)
    rollout = _rollout(plan, rows) if kind_of(run).prompts else None
    peak = max(planner.peak(rows), rollout["peak"] if rollout else 0)
    out: dict = {
        "memory": {
            "precision": run.precision,
            "recompute": run.recompute,
            "micro_batch_size": micro,
            "seq_length": seq,
            "microbatches": plan.grad_accum,
            "schedule": run.parallel.schedule if run.parallel.pp > 1 else None,
            "ranks": [
                {"ranks": list(r.ranks), "pp_rank": r.pp_rank, "in_flight": r.in_flight}
                | {k: getattr(r, k) for k in COLUMNS}
                for r in rows
            ],
            "rollout": rollout,
            "peak": peak,
            "allowance": planner.ALLOWANCE,
            "gpu_memory": gpu_memory,
            "fits": None if gpu_memory is None else peak + planner.ALLOWANCE <= gpu_memory,
        }
    }
    if gpu_memory is not None:  # the run's layout: the longest sequence each recompute fits
        out["memory"]["longest"] = {
            r: planner.longest_sequence(
                config, dataclasses.replace(par, recompute=r), plan.dp, micro, gpu_memory, run.attention
            )
            for r in RECOMPUTE
        }
    if gpus is not None:
        assert gpu_memory is not None
        out["layouts"] = _layouts(plan, gpus, gpu_memory)
    return out


def _rollout(plan: RunPlan, rows: list[planner.RankMemory]) -> dict:
    """An objective that samples (online RL): every rank completes the whole batch's rows, up to
    seq_length positions each, with the KV cache of its stages' layers beside its state and the
    step's buffers (FSDP2's gathered weights); the step's activations are not held then."""
    run = plan.run
    batch = run.batch.global_batch_size * plan.rows_per_sample
    caches = {
        r.pp_rank: planner.rollout_cache(
            plan.config, plan.parallelism, r.pp_rank, batch, run.batch.seq_length
        )
        for r in rows
    }
    return {
        "rows": batch,
        "positions": run.batch.seq_length,
        "cache": max(caches.values()),
        "peak": max(r.state + r.buffers + caches[r.pp_rank] for r in rows),
    }


def _layouts(plan: RunPlan, gpus: int, gpu_memory: int) -> dict:
    """Every layout of `gpus` GPUs, best first, and the longest sequence each fits, longest first."""
    run, config, par = plan.run, plan.config, plan.parallelism
    k = plan.rows_per_sample  # the planner counts rows: a preference pair is two
    micro, seq, batch = run.batch.micro_batch_size * k, run.batch.seq_length, run.batch.global_batch_size * k
    found = planner.search(config, par, gpus, gpu_memory, micro, seq, batch, run.attention)
    candidates = [
        dataclasses.asdict(c.dims)
        | {
            "recompute": c.recompute,
            "microbatches": c.microbatches,
            "peak": c.peak,
            "throughput": round(c.throughput, 4),
            "fits": c.fits,
            "reason": c.reason,
            "label": c.label,
        }
        for c in found
    ]
    longest = [
        dataclasses.asdict(c.dims)
        | {
            "microbatches": c.microbatches,
            "seq_length": c.seq,
            "throughput": round(c.throughput, 4),
            "label": c.label,
        }
        for c in planner.longest_sequences(config, par, gpus, gpu_memory, micro, batch, run.attention)
    ]
    return {"gpus": gpus, "candidates": candidates, "longest": longest}


def gib(n: int) -> str:
    return f"{n / planner.GiB:.1f}"


def rank_list(ranks: list[int], limit: int = 20) -> str:
    """Ranks as ranges, '0-7,16-23'; a long list is cut and counted."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return text if len(text) <= limit else f"{text[: limit - 3].rsplit(',', 1)[0]},.. ({len(ranks)})"


def memory_lines(report: dict) -> list[str]:
    """The plan as text: a table of the ranks, the verdict and the best layouts."""
    mem = report["memory"]
    schedule = f", {mem['schedule']}" if mem["schedule"] else ""
    lines = [
        f"memory per rank, GiB ({mem['precision']}, recompute {mem['recompute']}, micro batch "
        f"{mem['micro_batch_size']} x {mem['seq_length']} tokens, {mem['microbatches']} microbatches{schedule}):",
        f"  {'ranks':<20} {'stage':>5} {'in flight':>9} " + " ".join(f"{c:>11}" for c in COLUMNS),
    ]
    for r in mem["ranks"]:
        cells = " ".join(f"{gib(r[c]):>11}" for c in COLUMNS)
        lines.append(f"  {rank_list(r['ranks']):<20} {r['pp_rank']:>5} {r['in_flight']:>9} {cells}")
    if mem["rollout"]:
        ro = mem["rollout"]
        lines.append(
            f"  rollout: a KV cache of {ro['rows']} rows x {ro['positions']} positions, {gib(ro['cache'])} GiB "
            f"on the fullest rank; with its state and buffers {gib(ro['peak'])} GiB"
        )
    need = mem["peak"] + mem["allowance"]
    verdict = f"peak {gib(mem['peak'])} GiB + {gib(mem['allowance'])} GiB allowance = {gib(need)} GiB per GPU"
    if mem["gpu_memory"] is not None:
        verdict += f", of {gib(mem['gpu_memory'])} GiB: " + ("fits" if mem["fits"] else "does not fit")
    lines.append("  " + verdict)
    if "longest" in mem:
        by = mem["longest"]
        lines.append(
            f"  longest sequence that fits this layout: {tokens(by[mem['recompute']])} with recompute "
            f"{mem['recompute']} (the run's); "
            + ", ".join(f"{r}: {tokens(by[r], '')}" for r in by if r != mem["recompute"])
        )
    if "layouts" in report:
        layouts = report["layouts"]["candidates"]
        fitting = [c for c in layouts if c["fits"]]
        lines.append(
            f"layouts of {report['layouts']['gpus']} GPUs of {gib(mem['gpu_memory'])} GiB, by expected throughput "
            "(the model in megacore/planner):"
        )
        width = max([40] + [len(c["label"]) for c in fitting[:TOP]])  # cp's labels are longer
        for i, c in enumerate(fitting[:TOP], 1):
            lines.append(
                f"  {i}. {c['label']:<{width}} peak {gib(c['peak']):>6} GiB  throughput {c['throughput']:.2f}"
            )
        if not fitting:
            sized = [c for c in layouts if c["peak"]]
            if sized:
                least = min(sized, key=lambda c: c["peak"])
                lines.append(f"  none fits: the smallest peak is {gib(least['peak'])} GiB ({least['label']})")
            else:
                lines.append("  none: " + layouts[0]["reason"])
        else:
            lines.append(f"  {len(fitting)} of {len(layouts)} layouts fit")
        lines += longest_lines(report["layouts"], mem["micro_batch_size"])
    return lines


def tokens(n: int, unit: str = " tokens") -> str:
    """A longest sequence: '32,768 tokens', '0 tokens' (none fits); at the search's limit, 'or more'."""
    return f"{n:,}{unit}" + (" or more" if n >= planner.MAX_SEQ else "")


def longest_lines(layouts: dict, micro: int) -> list[str]:
    """The layouts that fit the longest sequence (with full recompute), and what less recompute fits."""
    found = [c for c in layouts["longest"] if c["seq_length"]["full"]]
    lines = [
        f"longest sequence that fits, by layout of {layouts['gpus']} GPUs (micro batch {micro}, "
        "the run's global batch):"
    ]
    for i, c in enumerate(found[:LONGEST_TOP], 1):
        by = c["seq_length"]
        lines.append(
            f"  {i}. {tokens(by['full'])} at {c['label']} with recompute full "
            f"(selective: {tokens(by['selective'], '')}, none: {tokens(by['none'], '')})"
        )
    if not found:
        lines.append("  none: no layout fits even the shortest sequence")
    return lines
