"""Distillation runs of mega-train (`objective` distill) against a plain PyTorch loop over
transformers that computes the loss from its formula (teacher and student both transformers
models), in tp 2 and dp 2 against one process, bad input, and the story: a small student distilled
from a larger teacher beats the same student trained on the corpus alone.

The data is one document of L tokens cut into samples of s = (L - 1) // 4 tokens: an epoch holds
exactly 4 samples (windows k·s .. k·s + s of the document), and the global batch is 4, so every
step's batch is the same 4 windows in some order, and the loop needs no knowledge of the run's
shuffle: a mean over tokens does not depend on their order."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_one_line_error, run_in_process
from hf_cases import build, load_hf
from runlib import metrics, ok, torchrun, train, write_run
from tokenize_testlib import documents, write_jsonl

TEXT = (
    "The teacher knows more than the student, and the student learns from the teacher's "
    "distributions over every next token, not only from the one token the corpus holds there. "
    "Soft targets carry how alike the other tokens are, which one hard label cannot say."
)
STEPS = 10
OPT = {"lr": 2e-3, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.1, "grad_clip": 1.0}
REL = 1e-5
COMPARED = ("loss", "distill/ce", "distill/kl")


@pytest.fixture(scope="module")
def doc(tmp_path_factory, sp_model: Path) -> tuple[Path, list[int]]:
    """The one-document tokens artifact and its ids."""
    root = tmp_path_factory.mktemp("distill-doc")
    src = write_jsonl(root / "doc.jsonl", [{"text": TEXT}])
    proc = run_in_process("mega-tokenize", src, root / "tokens", "--tokenizer", sp_model)
    assert proc.returncode == 0, proc.stderr
    (ids,) = documents(root / "tokens")
    return root / "tokens", ids


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A 2-layer student and a larger teacher (4 layers, hidden 96): HF directories and converted."""
    root = tmp_path_factory.mktemp("distill-models")
    shape = {"vocab_size": 400, "max_position_embeddings": 256}
    out = {
        "student_hf": build("llama", root / "student_hf", num_hidden_layers=2, **shape),
        "teacher_hf": build(
            "llama", root / "teacher_hf", num_hidden_layers=4, hidden_size=96, intermediate_size=128, **shape
        ),
    }
    for name in ("student", "teacher"):
        assert run_in_process("mega-convert", "hf", out[f"{name}_hf"], root / name).returncode == 0
        out[name] = root / name
    return out


def seq_length(ids: list[int]) -> int:
    return (len(ids) - 1) // 4


def distill_run(
    directory: Path, doc: tuple[Path, list[int]], models: dict, objective: dict, **overrides
) -> Path:
    tokens, ids = doc
    settings = {
        "train_steps": STEPS, "optimizer": OPT, "eval": {"every": 0}, "checkpoint": {"every": 100},
        "data": {"sources": [{"path": str(tokens)}], "split": [1.0]},
        "batch": {"micro_batch_size": 2, "global_batch_size": 4, "seq_length": seq_length(ids)},
        "objective": {"type": "distill", "teacher": str(models["teacher"]), **objective},
    }  # fmt: skip
    return write_run(directory, tokens, init=models["student"], **{**settings, **overrides})


def divergence(student: torch.Tensor, teacher: torch.Tensor, kind: str, t: float) -> torch.Tensor:
    """Per position [b, s], written here from the definitions: KL(p‖q), KL(q‖p), or ½KL(p‖m) +
    ½KL(q‖m) with m = (p + q)/2; p the teacher's softmax at temperature t, q the student's."""
    log_p, log_q = F.log_softmax(teacher / t, -1), F.log_softmax(student / t, -1)
    if kind == "forward_kl":
        return F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    if kind == "reverse_kl":
        return F.kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1)
    m = (log_p.exp() + log_q.exp()) / 2
    return 0.5 * (F.kl_div(m.log(), log_p, reduction="none", log_target=True).sum(-1)
                  + F.kl_div(m.log(), log_q, reduction="none", log_target=True).sum(-1))  # fmt: skip


def plain_loop(models: dict, ids: list[int], objective: dict) -> list[dict]:
    """AdamW steps over the 4 windows, as mega-train's optimizer is set (no decay of 1-D weights):
    each step's loss a·CE + (1 − a)·T²·D averaged over every target, and its two parts."""
    student, teacher = load_hf(models["student_hf"]).train(), load_hf(models["teacher_hf"])
    s, a, t = seq_length(ids), objective["alpha"], objective["temperature"]
    windows = torch.tensor([ids[k * s : k * s + s + 1] for k in range(4)])
    x, y = windows[:, :-1], windows[:, 1:]
    params = list(student.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]  # fmt: skip
    opt = torch.optim.AdamW(groups, lr=OPT["lr"], betas=(0.9, 0.95), eps=1e-8)
    with torch.no_grad():
        theirs = teacher(x).logits.float()
    records = []
    for _ in range(STEPS):
        ours = student(x).logits.float()
        ce = F.cross_entropy(ours.flatten(0, 1), y.flatten())
        d = divergence(ours, theirs, objective["divergence"], t).mean()
        loss = a * ce + (1 - a) * t**2 * d
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, OPT["grad_clip"])
        opt.step()
        records.append({"loss": loss.item(), "distill/ce": ce.item(), "distill/kl": d.item()})
    return records


def assert_records_close(got: list[dict], want: list[dict], rel: float = REL) -> None:
    assert len(got) == len(want) == STEPS, (len(got), len(want))
    for step, (g, w) in enumerate(zip(got, want, strict=True), 1):
        for name in COMPARED:
            assert abs(g[name] - w[name]) <= rel * abs(w[name]), (step, name, g[name], w[name])


CASES = [
    {"divergence": "forward_kl", "alpha": 0.0, "temperature": 1.0},
    {"divergence": "forward_kl", "alpha": 0.5, "temperature": 2.0},
    {"divergence": "reverse_kl", "alpha": 0.0, "temperature": 2.0},
    {"divergence": "reverse_kl", "alpha": 0.5, "temperature": 1.0},
    {"divergence": "jsd", "alpha": 0.0, "temperature": 2.0},
    {"divergence": "jsd", "alpha": 0.5, "temperature": 2.0},
]


@pytest.mark.parametrize(
    "objective", CASES, ids=lambda c: f"{c['divergence']}-a{c['alpha']}-T{c['temperature']}"
)
def test_steps_equal_the_formula_over_transformers(
    tmp_path: Path, doc: tuple[Path, list[int]], models: dict, objective: dict
) -> None:
    """10 AdamW steps, fp32: every step's loss, cross entropy and divergence within 1e-5 relative
    of the plain loop's (fp32 sums over ~100 tokens of a 400-word vocab agree to ~1e-7; AdamW
    divides each update by its own moments, so 10 steps keep them within 1e-5)."""
    ok(train(distill_run(tmp_path, doc, models, objective)))
    got = metrics(tmp_path / "run")
    want = plain_loop(models, doc[1], objective)
    assert_records_close(got, want)
    assert want[-1]["loss"] < want[0]["loss"]  # it learned: the comparison is not of constants


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, doc, models) -> Path:
    d = tmp_path_factory.mktemp("distill-one")
    ok(train(distill_run(d, doc, models, CASES[1])))
    return d / "run"


@pytest.mark.dist
# `make test-slow` (make test: the formula in one process; the vocab-parallel divergence at tp 2 in
# tests/parallel/test_equivalence.py's scenarios is the loss's, not the teacher's)
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp", "dp"])
def test_two_processes_equal_one(
    tmp_path: Path, doc: tuple[Path, list[int]], models: dict, one_process: Path, layout: str
) -> None:
    """tp 2 (the divergence vocab-parallel: each rank its half of the vocab, never the whole) and
    dp 2 (the teacher sharded by FSDP2 like the student) equal one process within 1e-5 relative."""
    parallel = {"tp": 2} if layout == "tp" else {}
    ok(torchrun(2, distill_run(tmp_path, doc, models, CASES[1], parallel=parallel)))
    want = metrics(one_process)
    assert_records_close(metrics(tmp_path / "run"), want)


def test_bad_objectives_are_refused_in_one_line(
    tmp_path: Path, doc: tuple[Path, list[int]], models: dict, sp_model: Path
) -> None:
    good = {"divergence": "forward_kl", "alpha": 0.5, "temperature": 1.0}
    for name, objective, words in (
        ("t0", {**good, "temperature": 0}, ("temperature",)),
        ("a2", {**good, "alpha": 1.5}, ("alpha",)),
        ("kind", {**good, "divergence": "tvd"}, ("divergence",)),
    ):
        assert_one_line_error(train(distill_run(tmp_path / name, doc, models, objective)), *words)
    missing = distill_run(tmp_path / "missing", doc, models, good)
    text = missing.read_text().replace(f'"teacher": "{models["teacher"]}"', '"teacher": "nowhere"')
    missing.write_text(text)
    assert_one_line_error(train(missing), "$.objective.teacher", "not a checkpoint")
    hf = build(
        "llama", tmp_path / "wide_hf", num_hidden_layers=2, vocab_size=300, max_position_embeddings=256
    )
    assert run_in_process("mega-convert", "hf", hf, tmp_path / "wide").returncode == 0
    other = distill_run(tmp_path / "vocab", doc, {**models, "teacher": tmp_path / "wide"}, good)
    assert_one_line_error(train(other), "$.objective.teacher", "vocab_size 300")
    pp = distill_run(tmp_path / "pp", doc, models, good, parallel={"pp": 2})
    assert_one_line_error(train(pp, "--dry-run", "--world-size", "2"), "$.parallel.pp 2", "tp, cp or dp")
    lm = distill_run(tmp_path / "lm", doc, models, good)
    lm.write_text(lm.read_text().replace('"type": "distill"', '"type": "lm"'))
    assert_one_line_error(train(lm), "lm has no teacher")


@pytest.mark.slow
def test_a_small_student_learns_more_from_a_teacher_than_from_the_corpus_alone(
    tmp_path: Path, tokens: Path
) -> None:
    """The story: a 4-layer teacher trained on the corpus; a 2-layer student distilled from it
    (forward KL at T 1, a 0.5) reaches a lower held-out loss than the same student trained on the
    corpus alone for the same steps, from the same start and the same batches."""
    from runlib import TINY_LLAMA

    teacher_config = {**TINY_LLAMA, "hidden_size": 64, "ffn_hidden_size": 128}
    steps = {"train_steps": 400, "optimizer": {"lr": 5e-3, "warmup_steps": 10, "min_lr": 5e-4}}
    teacher = write_run(tmp_path / "teacher", tokens, model={"config": teacher_config}, **steps)
    ok(train(teacher))
    student = {"model": {"config": {**TINY_LLAMA, "num_layers": 2}}, "train_steps": 40,
               "eval": {"every": 40, "iters": 4}, "checkpoint": {"every": 40}}  # fmt: skip
    last = sorted((tmp_path / "teacher" / "run" / "checkpoints").glob("step-*"))[-1]
    objective = {
        "type": "distill",
        "teacher": str(last),
        "divergence": "forward_kl",
        "alpha": 0.5,
        "temperature": 1.0,
    }
    distilled = write_run(tmp_path / "distilled", tokens, objective=objective, **student)
    alone = write_run(tmp_path / "alone", tokens, **student)
    ok(train(distilled))
    ok(train(alone))
    held_out = {name: metrics(tmp_path / name / "run", "eval")[-1]["loss"] for name in ("distilled", "alone")}
    teacher_loss = metrics(tmp_path / "teacher" / "run", "eval")[-1]["loss"]
    print(f"held-out loss after 40 steps: distilled {held_out['distilled']:.4f}, alone {held_out['alone']:.4f}"
          f" (the teacher after 400: {teacher_loss:.4f})")  # fmt: skip
    assert held_out["distilled"] < held_out["alone"], held_out


@pytest.mark.slow
def test_students_learn_an_assistant_reply_from_the_teacher_alone(tmp_path: Path, sp_model: Path) -> None:
    """Chat data, the loss on the assistant's tokens: a teacher fine-tuned on it knows the one reply
    every conversation ends with. Distilled with a = 0 (the teacher's distributions on the
    assistant's tokens alone, no hard labels), a whole student on the untrained base learns the
    reply as the teacher knows it, and a LoRA student (rank 8 on a random 2-layer base, which
    bounds what it can learn) more of it than the same LoRA trained on the reply's tokens."""
    from runlib import TINY_LLAMA
    from tokenize_testlib import CHATML

    reply = "Thank you for asking, the answer is always forty two."

    rng = random.Random(0)
    convs = [
        {"messages": [{"role": "user", "content": f"question {rng.randrange(10**6)}"},
                      {"role": "assistant", "content": reply}]}
        for _ in range(200)
    ]  # fmt: skip
    src = write_jsonl(tmp_path / "chat.jsonl", convs)
    chat = tmp_path / "tokens"
    assert (
        run_in_process("mega-tokenize", src, chat, "-t", sp_model, "--format", "chat", *CHATML).returncode
        == 0
    )
    shape = {k: TINY_LLAMA[k] for k in ("hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size")}
    hf = build(
        "llama", tmp_path / "base_hf", vocab_size=416, max_position_embeddings=128, num_hidden_layers=2,
        hidden_size=shape["hidden_size"], num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"], intermediate_size=shape["ffn_hidden_size"],
    )  # fmt: skip
    assert run_in_process("mega-convert", "hf", hf, tmp_path / "base").returncode == 0
    common = {
        "data": {"sources": [{"path": str(chat)}], "split": [0.9, 0.1], "loss_on": "assistant"},
        "batch": {"micro_batch_size": 4, "global_batch_size": 8, "seq_length": 64},
        "optimizer": {"lr": 2e-2, "warmup_steps": 4, "min_lr": 1e-3},
        "train_steps": 60, "eval": {"every": 60, "iters": 2}, "checkpoint": {"every": 60},
    }  # fmt: skip
    ok(train(write_run(tmp_path / "teacher", chat, init=tmp_path / "base", **common)))
    teacher = tmp_path / "teacher" / "run" / "checkpoints" / "latest"
    lora = {
        "rank": 8,
        "alpha": 16,
        "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    }
    objective = {"type": "distill", "teacher": str(teacher), "alpha": 0.0, "temperature": 1.0}
    longer = {**common, "optimizer": {"lr": 5e-2, "warmup_steps": 4, "min_lr": 5e-3}, "train_steps": 120,
              "eval": {"every": 120, "iters": 2}, "checkpoint": {"every": 120}}  # fmt: skip
    held_out = {}
    for name, extra in (
        ("whole", {"objective": objective}),
        ("lora", {"lora": lora, "objective": objective}),
        ("lora_on_labels", {"lora": lora}),
    ):
        ok(train(write_run(tmp_path / name, chat, init=tmp_path / "base", **extra, **longer)))
        held_out[name] = metrics(tmp_path / name / "run", "eval")[-1]["loss"]
    base = metrics(tmp_path / "teacher" / "run")[0]["loss"]  # the base's loss on the reply, step 1
    taught = metrics(tmp_path / "teacher" / "run", "eval")[-1]["loss"]
    print(f"held-out loss on the reply: base {base:.3f}, teacher {taught:.3f}, students {held_out}")
    assert taught < 0.05 and held_out["whole"] < 0.05, (taught, held_out)
    assert held_out["lora"] < held_out["lora_on_labels"] < base, (base, held_out)
