"""Fixtures for the artifact-contract tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import write_checkpoint


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    write_checkpoint(tmp_path / "ckpt", {"embed.weight": torch.randn(64, 16), "norm.weight": torch.ones(16)})
    return tmp_path / "ckpt"
