"""Instruction tuning end to end: a real chat tokens artifact (mega-tokenize --format chat with
ChatML markers), packed conversations, loss on the assistant's tokens only.

Every conversation is a random user message and the same assistant reply. With `loss_on:
assistant` the reported loss is the reply's alone, which the model learns to near zero; with
`all` the loss also covers the random user text, which it cannot learn, so it stays high."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from helpers import assert_one_line_error, run_in_process, run_tool
from hf_cases import randomize
from runlib import TINY_LLAMA, assert_losses_close, losses, metrics, ok, torchrun, train, write_run
from tokenize_testlib import CHATML, corpus, write_jsonl

REPLY = "Thank you for asking, the answer is always forty two."


@pytest.fixture(scope="module")
def chat(tmp_path_factory, sp_model: Path) -> Path:
    root = tmp_path_factory.mktemp("chat")
    rng = random.Random(0)
    texts = corpus(200)
    convs = [
        {
            "messages": [
                {"role": "user", "content": rng.choice(texts)[rng.randrange(20) :][:60]},
                {"role": "assistant", "content": REPLY},
            ]
        }
        for _ in range(300)
    ]
    src = write_jsonl(root / "chat.jsonl", convs)
    run_tool("mega-tokenize", src, root / "tokens", "-t", sp_model, "--format", "chat", *CHATML, check=True)
    return root / "tokens"


def chat_run(directory: Path, tokens: Path, **overrides) -> Path:
    """80 steps of the tiny Llama (its vocab room for the ChatML markers) on the chat data."""
    return write_run(
        directory,
        tokens,
        **{
            "model": {"config": {**TINY_LLAMA, "vocab_size": 416, "max_seq_len": 128}},
            "data": {"sources": [{"path": str(tokens)}], "split": [0.9, 0.1]},
            "batch": {"micro_batch_size": 4, "global_batch_size": 8, "seq_length": 96},
            "train_steps": 80,
            "optimizer": {"lr": 2e-2, "warmup_steps": 4, "min_lr": 1e-3},
            "eval": {"every": 20, "iters": 2},
            "checkpoint": {"every": 1000},
            **overrides,
        },
    )


def test_loss_on_the_assistant_learns_the_reply_and_all_does_not(tmp_path: Path, chat: Path) -> None:
    runs = {}
    for loss_on in ("assistant", "all"):
        run_json = chat_run(tmp_path / loss_on, chat, data={"loss_on": loss_on})
        ok(train(run_json))
        runs[loss_on] = run_json.parent / "run"
    assistant, everything = losses(runs["assistant"]), losses(runs["all"])
    assert assistant[-1] < 0.05, assistant
    assert everything[-1] > 1.0, everything
    # Evaluation counts the same tokens: the reply is predicted, token by token, on held-out data.
    final = metrics(runs["assistant"], "eval")[-1]
    assert final["loss"] < 0.05 and final["accuracy"] > 0.99, final
    assert "assistant_loss" not in final  # the loss is on the assistant's tokens already
    # Trained on every token, evaluation reports the assistant's tokens apart: learnt there too.
    final = metrics(runs["all"], "eval")[-1]
    assert final["assistant_loss"] < 0.1 < 1.0 < final["loss"], final
    assert final["assistant_accuracy"] > final["accuracy"], final


def test_one_conversation_per_sample_learns_it_too(tmp_path: Path, chat: Path) -> None:
    run_json = chat_run(tmp_path, chat, data={"loss_on": "assistant", "packing": "pad"})
    ok(train(run_json))
    assert losses(run_json.parent / "run")[-1] < 0.1


@pytest.mark.dist
@pytest.mark.parametrize(
    "nproc,parallel",
    [
        # make test-slow (make test runs conversations under torchrun with LoRA, and document
        # masking under a pipeline and dp, below)
        pytest.param(2, {"pp": 2, "schedule": "1f1b"}, marks=pytest.mark.slow),
        # 4 processes on 2 cores: the engine's packed tp 2 x pp 2 ZBV is an equivalence scenario
        pytest.param(
            4, {"tp": 2, "pp": 2, "sequence_parallel": True, "schedule": "zbv"}, marks=pytest.mark.slow
        ),
    ],
    ids=["pp2", "tp2-pp2-zbv"],
)
def test_packed_conversations_under_a_pipeline_match_one_process(
    tmp_path: Path, chat: Path, nproc: int, parallel: dict
) -> None:
    """Every stage takes the packed documents' positions from the batch: the losses (assistant
    tokens only) and the evaluation match one process at every step (fp32)."""
    runs = {}
    for name, n, layout in (("one", 1, {}), ("pipeline", nproc, parallel)):
        run_json = chat_run(
            tmp_path / name, chat, data={"loss_on": "assistant"}, parallel=layout, train_steps=6,
            eval={"every": 3, "iters": 2}, batch={"micro_batch_size": 2, "global_batch_size": 8, "seq_length": 96},
        )  # fmt: skip
        ok(torchrun(n, run_json) if n > 1 else train(run_json))
        runs[name] = run_json.parent / "run"
    assert_losses_close(losses(runs["pipeline"]), losses(runs["one"]))
    evals = [[r["loss"] for r in metrics(runs[k], "eval")] for k in ("pipeline", "one")]
    assert_losses_close(*evals)


@pytest.mark.slow  # 14 s; in make test: the equivalence tests' packed documents at pp 2 x dp 2
@pytest.mark.dist
def test_document_masking_under_pipeline_and_dp_matches_one_process(tmp_path: Path, tokens: Path) -> None:
    """Pretraining text with `doc_mask: true`, pp2 x dp2 (the dp ranks' rows count their own
    documents' targets) against one process."""
    runs = {}
    for name, n, layout in (("one", 1, {}), ("pp2-dp2", 4, {"pp": 2, "schedule": "gpipe"})):
        run_json = write_run(tmp_path / name, tokens, data={"doc_mask": True}, parallel=layout, train_steps=5)
        ok(torchrun(n, run_json) if n > 1 else train(run_json))
        runs[name] = run_json.parent / "run"
    assert_losses_close(losses(runs["pp2-dp2"]), losses(runs["one"]))


def test_loss_on_assistant_needs_chat(tmp_path: Path, tokens: Path) -> None:
    run_json = chat_run(tmp_path / "text", tokens, data={"loss_on": "assistant"})
    assert_one_line_error(train(run_json), "loss_on assistant needs a chat tokens artifact")


@pytest.mark.dist
def test_lora_on_conversations_under_torchrun_exports_an_adapter_peft_answers_with(
    tmp_path: Path, chat: Path
) -> None:
    """The chain: a transformers model converted, LoRA adapters trained on the conversations (the
    assistant's tokens) under torchrun (dp 2, FSDP2), exported with --adapter; PEFT loads them on
    the transformers model, and, prompted with a user turn in the data's template, it answers the
    reply it was taught."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=416, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    randomize(model)  # weights large enough for a frozen head to tell tokens apart with confidence
    model.save_pretrained(tmp_path / "hf")
    run_in_process("mega-convert", "hf", tmp_path / "hf", tmp_path / "base", check=True)
    run_json = write_run(
        tmp_path / "lora", chat, init=tmp_path / "base",
        lora={"rank": 8, "alpha": 16, "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
        data={"sources": [{"path": str(chat)}], "split": [0.9, 0.1], "loss_on": "assistant"},
        batch={"micro_batch_size": 4, "global_batch_size": 8, "seq_length": 96}, train_steps=40,
        optimizer={"lr": 2e-2, "warmup_steps": 4, "min_lr": 1e-3}, eval={"every": 0}, checkpoint={"every": 40},
    )  # fmt: skip
    ok(torchrun(2, run_json))
    trained = losses(run_json.parent / "run")
    assert trained[-1] < trained[0] / 3, trained  # 6.17 -> 1.49 measured: the frozen head caps it
    adapter = tmp_path / "adapter"
    run_in_process("mega-export", run_json.parent / "run" / "checkpoints" / "step-00000040", adapter, "--adapter",
                   check=True)  # fmt: skip
    tok = AutoTokenizer.from_pretrained(adapter)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "hf"), adapter).eval()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the answer?"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    reply = tok(REPLY, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=len(reply), do_sample=False)
    assert tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip() == REPLY
