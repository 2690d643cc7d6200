"""Artifacts written by an earlier main load, train and export unchanged: tests/fixtures/e9be15e/
holds a converted tiny Llama and a checkpoint trained 2 steps from it, as the code of commit
e9be15e (main before issue #50's seams) wrote them (tests/fixtures/make_earlier.py says how). The
fixture is copied before use: nothing is ever written into the repository."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from helpers import run_in_process
from hf_cases import load_hf
from megacore.artifacts import open_artifact
from megacore.checkpoint import CheckpointReader
from runlib import metrics, ok, train, write_run

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "e9be15e"


@pytest.fixture()
def earlier(tmp_path: Path) -> Path:
    return shutil.copytree(FIXTURE, tmp_path / "e9be15e")


@pytest.mark.parametrize("name", ["converted", "trained"])
def test_an_earlier_mains_checkpoint_trains_and_exports(
    tmp_path: Path, earlier: Path, tokens: Path, name: str
) -> None:
    """Every file's sha256 as its manifest records it; 2 steps from it as `init` (its vocab and
    tokenizer the data's); its export loads in transformers, whose logits equal the checkpoint's
    Decoder's (fp32, within 1e-5 of their scale: the same weights, two implementations)."""
    ckpt = earlier / name
    open_artifact(ckpt, "checkpoint", verify="sha256")
    run_json = write_run(tmp_path / "run", tokens, init=ckpt, train_steps=2, eval={"every": 0})
    ok(train(run_json))
    assert [r["step"] for r in metrics(tmp_path / "run" / "run")] == [1, 2]
    ok(run_in_process("mega-export", ckpt, tmp_path / "hf"))
    ids = torch.arange(3, 35)[None]
    with torch.no_grad(), CheckpointReader(ckpt) as reader:
        ours = reader.decoder(torch.float32).eval()(ids)
        theirs = load_hf(tmp_path / "hf")(ids).logits
    vocab = theirs.shape[-1]
    torch.testing.assert_close(ours[..., :vocab], theirs, rtol=0, atol=1e-5 * theirs.abs().max().item())
