"""The chain through the tools' command lines (run in this process; tests/test_examples.py runs the
installed console scripts from a Makefile):
HF model -> mega-convert -> mega-shard (tp2 pp2) -> mega-export -> transformers."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from helpers import assert_one_line_error, run_in_process
from hf_cases import build, load_hf, tokens


def test_convert_shard_export_gives_back_the_same_model(tmp_path: Path):
    hf = build("llama2-70b-gqa", tmp_path / "hf")  # GQA, vocab 101 padded to 128 on the way
    run_in_process("mega-convert", "hf", hf, tmp_path / "ckpt", check=True)
    run_in_process(
        "mega-shard", tmp_path / "ckpt", tmp_path / "ckpt-tp2pp2", "--tp", "2", "--pp", "2", check=True
    )
    assert sorted(p.name for p in (tmp_path / "ckpt-tp2pp2").glob("*.safetensors")) == [
        f"model-pp{s:02d}-tp{r:02d}.safetensors" for s in range(2) for r in range(2)
    ]
    run_in_process("mega-export", tmp_path / "ckpt-tp2pp2", tmp_path / "out", check=True)
    run_in_process("mega-export", tmp_path / "ckpt", tmp_path / "out-tp1pp1", check=True)
    for name in ("model.safetensors", "config.json"):  # any layout exports the same bytes
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "out-tp1pp1" / name).read_bytes(), name

    before, after = load_file(hf / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert before.keys() == after.keys()
    for name, t in before.items():
        assert torch.equal(t, after[name]), name
    x = tokens(101, 16)
    with torch.no_grad():
        assert torch.equal(load_hf(hf)(x).logits, load_hf(tmp_path / "out")(x).logits)


def test_export_refuses_what_is_not_a_checkpoint(tmp_path: Path):
    (tmp_path / "half").mkdir()
    assert_one_line_error(
        run_in_process("mega-export", tmp_path / "half", tmp_path / "out"), "incomplete artifact"
    )
    assert not (tmp_path / "out").exists()
