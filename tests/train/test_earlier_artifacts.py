"""Artifacts written by earlier mains load, train and export unchanged: tests/fixtures/e9be15e/ holds
a converted tiny Llama and a checkpoint trained 2 steps from it, as the code of commit e9be15e (main
before issue #50's seams, format version 1) wrote them; tests/fixtures/ddb42ca/ the same of a tiny
DeepSeek V3 (latent attention, a mixture of experts with its router's bias moved as it trained), as
ddb42ca (main before the config's parts, format version 2) wrote them; tests/fixtures/63fb4c6/ the
same of a tiny Gemma 3 (Gemma's norms, four a block and on q/k heads, local and global RoPE, its
score scalar), as 63fb4c6 (main before the norm, RoPE and block parts, format version 3) wrote them;
tests/fixtures/make_earlier.py says how. A fixture is copied before use: nothing is ever written into the repository."""

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

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.mark.parametrize("commit", ["e9be15e", "ddb42ca", "63fb4c6"])
@pytest.mark.parametrize("name", ["converted", "trained"])
def test_an_earlier_mains_checkpoint_trains_and_exports(
    tmp_path: Path, tokens: Path, commit: str, name: str
) -> None:
    """Every file's sha256 as its manifest records it; 2 steps from it as `init` (its vocab and
    tokenizer the data's); its export loads in transformers, whose logits equal the checkpoint's
    Decoder's (fp32, within 1e-5 of their scale: the same weights, two implementations)."""
    ckpt = shutil.copytree(FIXTURES / commit / name, tmp_path / commit / name)
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
