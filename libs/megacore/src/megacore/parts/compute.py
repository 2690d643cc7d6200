"""What a part's planner term reads of a rank's training step (torch-free): the compute dtype's
bytes, the tensor-parallel size, the shards sequence parallel cuts the residual stream into, and
which of the Decoder's single-device fast paths run (`parallel.build_rules.fast_paths`). The
planner builds it from a `Parallelism` (`planner.activations`), so that the parts, one layer above
`parallel`, need not import it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Compute:
    c: int  # bytes of the compute dtype: 4 fp32, 2 bf16/fp16 (and fp8's, whose activations are bf16)
    tp: int
    sp: int  # sequence parallel's shards of the residual stream (tp with sequence parallel, else 1)
    fast: Mapping[str, bool]  # "norms", "head_norms", "projections"


Shapes = dict[str, tuple[int, ...]]  # contract name -> global shape, in state-dict order


def linear(out: Shapes, name: str, rows: int, cols: int, bias: bool) -> None:
    """A linear's weight [rows, cols] (and bias) appended to `out`."""
    out[f"{name}.weight"] = (rows, cols)
    if bias:
        out[f"{name}.bias"] = (rows,)
