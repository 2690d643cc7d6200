"""precision fp8 under FSDP2 all-gathers the block linears' weights in float8 (tensorwise
scaling): what each Float8Linear's forward sees is checked in fp8_gather_worker.py against the
single-process weights rounded to e4m3 by hand, and a checkpoint it saves against them."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import torchrun_script

pytest.importorskip("torchao", reason="fp8 needs torchao (requirements-dev.txt installs it)")


WORKER = Path(__file__).with_name("fp8_gather_worker.py")


def test_fsdp_gathers_float8_weights(tmp_path: Path) -> None:
    proc = torchrun_script(2, WORKER, tmp_path / "ckpt", env={"MEGA_FP8_EMULATE": "1"}, timeout=300)
    assert "PASS 28" in proc.stdout.splitlines(), proc.stdout
