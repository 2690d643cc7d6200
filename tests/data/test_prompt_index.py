"""Prompts as samples (`megacore.data.prompts.PromptIndex` through `Dataset.build`) on a real prompts
artifact: a sample is one prompt, every prompt of the split that leaves room for the completion
once per epoch in that epoch's order, the longer ones left out and counted, the splits disjoint; a
batch names each sample's document, whose columns are the input row's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import sentencepiece as spm

from mega_tokenize.pipeline import Options, tokenize
from megacore.artifacts.reader import open_artifact
from megacore.data.dataset import Dataset
from megacore.data.packing import PAD
from megacore.data.prompts import PromptColumns
from tokenize_testlib import write_jsonl

S, COMPLETION = 24, 8


def test_prompts_are_samples_of_their_split(tmp_path: Path, sp_model: Path) -> None:
    rows = [{"prompt": " ".join(["word"] * (1 + i % 7) * (3 if i % 10 == 9 else 1)), "answer": str(i)}
            for i in range(50)]  # fmt: skip
    out = tmp_path / "prompts"
    tokenize(Options(inputs=[str(write_jsonl(tmp_path / "p.jsonl", rows))], out=out, tokenizer=sp_model,
                     format="prompts", progress=False))  # fmt: skip
    m = open_artifact(out, "tokens")
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    ids = [sp.encode(r["prompt"]) for r in rows]
    fits = [i for i in range(40) if len(ids[i]) <= S + 1 - COMPLETION]  # the train split: 40 of 50
    assert 0 < len(fits) < 40
    build = {"sources": [(out, m, 1.0)], "split": [0.8, 0.2], "seq_length": S, "seed": 3,
             "completion_length": COMPLETION}  # fmt: skip
    train = Dataset.build(which="train", num_samples=3 * len(fits), **build)
    assert train.skipped_prompts == 40 - len(fits)
    batch = train.batch(0, len(train))
    docs = batch.documents[:, 1].tolist()
    assert set(batch.documents[:, 0].tolist()) == {0}
    epochs = [docs[k * len(fits) : (k + 1) * len(fits)] for k in range(3)]
    assert all(sorted(e) == fits for e in epochs) and epochs[0] != epochs[1]
    for row, doc in zip(batch.tokens, docs, strict=True):
        assert row[: len(ids[doc])].tolist() == ids[doc] and set(row[len(ids[doc]) :].tolist()) == {PAD}
    held_out = [i for i in range(40, 50) if len(ids[i]) <= S + 1 - COMPLETION]
    valid = Dataset.build(which="valid", num_samples=len(held_out), **build)
    assert sorted(valid.batch(0, len(valid)).documents[:, 1].tolist()) == held_out
    answers = PromptColumns(out, m).rows(np.array(docs[:5]))["answer"]
    assert answers == [rows[d]["answer"] for d in docs[:5]]
