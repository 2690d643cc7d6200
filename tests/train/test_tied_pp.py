"""Tied embeddings under pipeline parallel through the chain: a tiny Falcon in Falcon 40B's
architecture (new decoder architecture, tied as Falcon's config leaves it) converted by mega-convert,
trained at pp 2 under torchrun, resumed at pp 1 from the pp 2 checkpoint, and exported to a directory
transformers loads with the tie intact. (The numbers of every schedule, with tp and dp, against one
process: tests/parallel/test_equivalence.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from helpers import run_tool
from hf_cases import build, load_hf
from megacore.artifacts import open_artifact
from runlib import assert_losses_close, losses, metrics, ok, torchrun, train, write_run


def _run_json(directory: Path, init: Path, tokens: Path, **overrides) -> Path:
    return write_run(
        directory,
        tokens,
        init=init,
        batch={"micro_batch_size": 1},
        train_steps=4,
        checkpoint={"every": 2},
        eval={"every": 4, "iters": 1},
        **overrides,
    )


@pytest.mark.dist
@pytest.mark.slow  # 35 s; the tied embedding saved at pp 2 and resumed at pp 1: the equivalence tests
def test_tied_falcon_trains_at_pp2_resumes_at_pp1_and_exports_tied(tmp_path: Path, tokens: Path) -> None:
    hf = build("falcon-40b", tmp_path / "hf", vocab_size=400, num_hidden_layers=4)
    assert load_hf(hf).config.tie_word_embeddings
    ckpt = tmp_path / "ckpt"
    ok(run_tool("mega-convert", "hf", hf, ckpt))
    converted = open_artifact(ckpt, "checkpoint")
    assert converted.config.tie_embeddings and "lm_head.weight" not in converted.tensors

    pp2 = _run_json(tmp_path / "pp2", ckpt, tokens, parallel={"pp": 2})
    out = ok(torchrun(2, pp2))
    assert "world 2 = tp 1 x pp 2 x dp 1" in out.stdout
    run = pp2.parent / "run"
    saved = open_artifact(run / "checkpoints" / "latest", "checkpoint")
    # One tensor for the shared embedding, and its moments once: the last stage's copy is not saved.
    assert saved.layout.pp == 2 and "lm_head.weight" not in saved.tensors
    assert not any(name.endswith("lm_head.weight") for name in saved.tensors)

    # Resumed at pp 1 from the pp 2 run's step 2: steps 3 and 4 as the pp 2 run computed them.
    pp1 = _run_json(tmp_path / "pp1", ckpt, tokens)
    shutil.copytree(run, pp1.parent / "run", ignore=shutil.ignore_patterns("step-00000004", "latest"))
    proc = ok(train(pp1))
    assert "(step 2 of 4)" in proc.stdout
    assert [r["step"] for r in metrics(pp1.parent / "run")] == [1, 2, 3, 4]
    assert_losses_close(losses(pp1.parent / "run")[2:], losses(run)[2:])

    # Exported, the tie holds in transformers, and the logits are the checkpoint's.
    final = pp1.parent / "run" / "checkpoints" / "latest"
    exported = tmp_path / "exported"
    ok(run_tool("mega-export", final, exported))
    model = load_hf(exported)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.transformer.word_embeddings.weight.data_ptr()
    trained = torch.nn.functional.embedding(torch.arange(3), model.transformer.word_embeddings.weight)
    assert not torch.equal(
        trained, torch.nn.functional.embedding(torch.arange(3), load_hf(hf).lm_head.weight)
    )
    ok(run_tool("mega-convert", "verify", final, exported))
