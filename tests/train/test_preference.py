"""Preference runs of mega-train (DPO, IPO, SimPO, ORPO) against a plain PyTorch loop over
transformers that computes each objective from its paper's formula on the same token ids, and
against TRL's DPOTrainer; in every layout against one process; and the SFT -> DPO story.

The pairs are tokenized here with SentencePiece itself (prompt and completion apart, the
completion ending in EOS, as TRL does) and must be what `mega-tokenize --format preference` wrote.
Every step's batch is every pair of the data (global batch = the pairs), so the loop needs no
knowledge of the run's shuffle: a mean over pairs does not depend on their order."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_one_line_error, run_in_process
from hf_cases import build, load_hf
from megacore.artifacts import open_artifact
from runlib import TINY_LLAMA, metrics, ok, torchrun, train, write_run
from tokenize_testlib import documents, write_jsonl

PAIRS = [
    ("What colour is the sky?", "The sky is blue on a clear day.", "Green, mostly."),
    ("Name a fruit.", "An apple is a fruit.", "A chair."),
    ("How many legs has a cat?", "A cat has four legs.", "Seven or so."),
    ("Where does the sun rise?", "The sun rises in the east.", "Under the sea."),
]
# Held out: the valid split of a run over PAIRS + VALID (split by pairs, half and half).
VALID = [
    ("Name a colour.", "Red is a colour.", "A spoon."),
    ("What do bees make?", "Bees make honey.", "Bricks, mostly."),
    ("Is ice cold?", "Yes, ice is cold.", "It is warm."),
    ("What is two plus two?", "Two plus two is four.", "Nine."),
]
STEPS = 10
OPT = {"lr": 2e-3, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.1, "grad_clip": 1.0}
REL = 1e-5
COMPARED = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, sp_model: Path) -> Path:
    root = tmp_path_factory.mktemp("pairs")
    src = write_jsonl(root / "pairs.jsonl", [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS])
    out = root / "tokens"
    proc = run_in_process("mega-tokenize", src, out, "--tokenizer", sp_model, "--format", "preference")
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random Llama (4 layers: ZBV puts two stages on each of 2 ranks) as transformers saves
    it, and converted: (HF directory, checkpoint)."""
    root = tmp_path_factory.mktemp("pref-base")
    hf = build("llama", root / "hf", vocab_size=400, num_hidden_layers=4, max_position_embeddings=256)
    assert run_in_process("mega-convert", "hf", hf, root / "base").returncode == 0
    return hf, root / "base"


def rows(
    sp_model: Path, pairs: list[tuple[str, str, str]] = PAIRS
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Chosen, rejected, chosen, ...: (ids, mask of the completion's tokens)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    out = []
    for prompt, *sides in pairs:
        p = sp.encode(prompt)
        for side in sides:
            c = [*sp.encode(side), sp.eos_id()]
            out.append((torch.tensor(p + c), torch.tensor([0] * len(p) + [1] * len(c), dtype=torch.bool)))
    return out


def sequence_logps(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log π(completion | prompt): the completion tokens' log-probabilities, summed."""
    logits = model(ids[None]).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0]
    return (lp * mask[1:]).sum()


def paper_loss(kind: str, beta: float, pc, pr, rc, rr, nc: int, nr: int, nll_c) -> torch.Tensor:
    """One pair's loss as the papers write it (DPO eq. 7, IPO eq. 17, SimPO eq. 6, ORPO eq. 6-7)."""
    if kind == "dpo":
        return -F.logsigmoid(beta * ((pc - rc) - (pr - rr)))
    if kind == "ipo":
        return ((pc - rc) - (pr - rr) - 1 / (2 * beta)) ** 2
    if kind == "simpo":
        return -F.logsigmoid(beta / nc * pc - beta / nr * pr - 0.5)
    odds_c = torch.exp(pc / nc) / (1 - torch.exp(pc / nc))
    odds_r = torch.exp(pr / nr) / (1 - torch.exp(pr / nr))
    return nll_c / nc - beta * F.logsigmoid(torch.log(odds_c / odds_r))


def batch_record(kind: str, beta: float, data: list, logps: list, ref: list) -> tuple[torch.Tensor, dict]:
    """The mean loss over the pairs of `data` and TRL's six metrics, from the papers' formulas."""
    losses, rewards = [], []
    for k in range(0, len(data), 2):
        pc, pr, nc, nr = logps[k], logps[k + 1], int(data[k][1].sum()), int(data[k + 1][1].sum())
        losses.append(paper_loss(kind, beta, pc, pr, ref[k], ref[k + 1], nc, nr, -pc))
        if kind in ("dpo", "ipo"):
            rewards.append(
                (beta * (pc - ref[k]).item(), beta * (pr - ref[k + 1]).item(), pc.item(), pr.item())
            )
        else:
            rewards.append((beta * pc.item() / nc, beta * pr.item() / nr, pc.item() / nc, pr.item() / nr))
    loss, n = torch.stack(losses).mean(), len(rewards)
    return loss, {
        "loss": loss.item(),
        "rewards/chosen": sum(r[0] for r in rewards) / n,
        "rewards/rejected": sum(r[1] for r in rewards) / n,
        "rewards/accuracies": sum(r[0] > r[1] for r in rewards) / n,
        "rewards/margins": sum(r[0] - r[1] for r in rewards) / n,
        "logps/chosen": sum(r[2] for r in rewards) / n,
        "logps/rejected": sum(r[3] for r in rewards) / n,
    }


def plain_loop(
    hf: Path, data: list, kind: str, beta: float, steps: int = STEPS, valid: list | None = None
) -> tuple[list[dict], dict | None]:
    """AdamW steps over all pairs of `data`, as mega-train's optimizer is set (no decay of 1-D
    weights): each step's record, and the record over the pairs of `valid` after the last."""
    policy, reference = load_hf(hf).train(), load_hf(hf)
    params = list(policy.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]  # fmt: skip
    opt = torch.optim.AdamW(groups, lr=OPT["lr"], betas=(0.9, 0.95), eps=1e-8)
    with torch.no_grad():
        ref = [sequence_logps(reference, ids, mask) for ids, mask in data]
    records = []
    for _ in range(steps):
        loss, record = batch_record(kind, beta, data, [sequence_logps(policy, i, m) for i, m in data], ref)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, OPT["grad_clip"])
        opt.step()
        records.append(record)
    if valid is None:
        return records, None
    with torch.no_grad():
        ref = [sequence_logps(reference, ids, mask) for ids, mask in valid]
        return records, batch_record(
            kind, beta, valid, [sequence_logps(policy, i, m) for i, m in valid], ref
        )[1]


def assert_records_close(
    got: list[dict], want: list[dict], beta: float, names: tuple[str, ...] = COMPARED
) -> None:
    """Each record's `names` within REL of `want`'s: relative for the loss and log-probabilities, and
    for a reward (β times a difference of two close log-probabilities) relative to those
    log-probabilities; `rewards/accuracies` exactly."""
    assert len(got) == len(want), (len(got), len(want))
    for g, w in zip(got, want, strict=True):
        logps = max(abs(w["logps/chosen"]), abs(w["logps/rejected"]))
        for name in names:
            tol = REL * (2 * beta * logps if name.startswith("rewards/") else abs(w[name]))
            assert abs(g[name] - w[name]) <= tol, (g.get("step"), name, g[name], w[name])
        if "rewards/accuracies" in names:
            assert g["rewards/accuracies"] == w["rewards/accuracies"], g.get("step")


def preference_run(directory: Path, pairs: Path, base: Path, objective: dict, **overrides) -> Path:
    settings = {
        "train_steps": STEPS, "optimizer": OPT, "eval": {"every": 0}, "checkpoint": {"every": 100},
        "data": {"sources": [{"path": str(pairs)}], "split": [1.0]},
        "batch": {"micro_batch_size": 2, "global_batch_size": len(PAIRS), "seq_length": 48},
    }  # fmt: skip
    return write_run(directory, pairs, init=base, objective=objective, **{**settings, **overrides})


def test_the_artifact_holds_the_pairs_as_tokenized_apart(pairs: Path, sp_model: Path) -> None:
    data = rows(sp_model)
    assert documents(pairs) == [ids.tolist() for ids, _ in data]
    completion = json.loads((pairs / "manifest.json").read_text())["roles"]["completion"]
    assert [[r == completion for r in doc] for doc in documents(pairs, "roles")] == [
        m.tolist() for _, m in data
    ]


@pytest.mark.parametrize(
    ("kind", "objective"),
    [
        ("dpo", {"type": "dpo", "beta": 0.1}),
        ("ipo", {"type": "dpo", "loss": "ipo", "beta": 0.1}),
        ("simpo", {"type": "simpo", "beta": 2.0, "gamma": 0.5}),
        ("orpo", {"type": "orpo", "beta": 0.1}),
    ],
)
def test_losses_and_rewards_equal_the_papers_formulas_over_transformers(
    tmp_path: Path, pairs: Path, base: tuple[Path, Path], sp_model: Path, kind: str, objective: dict
) -> None:
    """10 AdamW steps, fp32: every step's loss and log-probabilities within 1e-5 relative, and the
    rewards within 1e-5 of the log-probabilities they are differences of (the accuracies exactly),
    of the plain loop's, which computes the objective on transformers' logits. IPO's loss, a square
    that training drives towards 0, within what 1e-5 of its log-probabilities makes of it."""
    hf, ckpt = base
    ok(train(preference_run(tmp_path, pairs, ckpt, objective)))
    got = metrics(tmp_path / "run")
    want, _ = plain_loop(hf, rows(sp_model), kind, objective["beta"])
    assert len(got) == STEPS
    for step, (g, w) in enumerate(zip(got, want, strict=True), 1):
        # A DPO reward is β times a difference of two close log-probabilities: its error is
        # relative to theirs (fp32 sums of ~15 tokens agree to ~1e-7 here).
        logps = max(abs(w["logps/chosen"]), abs(w["logps/rejected"]))
        tol = {name: REL * abs(value) for name, value in w.items()}
        tol |= {name: REL * 2 * objective["beta"] * logps for name in w if name.startswith("rewards/")}
        if kind == "ipo":  # (h - 1/2β)² near its minimum: 2 |h - 1/2β| times h's error (4 sums)
            dh = REL * 4 * logps
            tol["loss"] = 2 * math.sqrt(w["loss"]) * dh + dh**2
        for name, value in w.items():
            assert abs(g[name] - value) <= tol[name], (step, name, g[name], value)
    assert want[-1]["loss"] < want[0]["loss"]  # it learned something: the comparison is not of constants
    # A checkpoint counts what the batch counts: pairs.
    t = open_artifact(tmp_path / "run" / "checkpoints" / "latest", "checkpoint").training
    assert (t.consumed_samples, t.consumed_unit) == (STEPS * len(PAIRS), "pairs")


def test_bad_objectives_are_refused_in_one_line(
    tmp_path: Path, pairs: Path, base: tuple[Path, Path], tokens: Path
) -> None:
    _, ckpt = base
    assert_one_line_error(
        train(preference_run(tmp_path / "beta", pairs, ckpt, {"type": "dpo", "beta": 0})), "beta"
    )
    lm = write_run(
        tmp_path / "lm", pairs, init=ckpt, data={"sources": [{"path": str(pairs)}], "split": [1.0]}
    )
    assert_one_line_error(train(lm), "preference pairs", "$.objective.type")
    plain = write_run(tmp_path / "plain", tokens, init=ckpt, objective={"type": "dpo"})
    assert_one_line_error(train(plain), "$.objective.type dpo trains on pairs", "--format preference")
    fresh = write_run(
        tmp_path / "fresh", pairs, objective={"type": "dpo"}, data={"sources": [{"path": str(pairs)}]}
    )
    assert_one_line_error(train(fresh), "$.model.init", "reference")


LAYOUT_STEPS = {"train_steps": 3}
LORA = {
    "rank": 4,
    "alpha": 8,
    "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, pairs: Path, base: tuple[Path, Path]) -> dict[str, Path]:
    """Three DPO steps in one process, full and LoRA: what every layout must give."""
    out = {}
    for name, extra in (("full", {}), ("lora", {"lora": LORA})):
        d = tmp_path_factory.mktemp(f"dpo-one-{name}")
        ok(train(preference_run(d, pairs, base[1], {"type": "dpo", "beta": 0.1}, **LAYOUT_STEPS, **extra)))
        out[name] = d / "run"
    return out


@pytest.mark.parametrize(
    "layout",
    [
        # `make test` runs LoRA over FSDP2; pipelines and the rest with `make test-slow`.
        pytest.param({"parallel": {"tp": 2, "sequence_parallel": True}}, marks=pytest.mark.slow),
        pytest.param({"parallel": {"pp": 2, "schedule": "1f1b"}}, marks=pytest.mark.slow),
        pytest.param({"parallel": {"pp": 2, "schedule": "zbv"}}, marks=pytest.mark.slow),
        pytest.param({"parallel": {"cp": 2}}, marks=pytest.mark.slow),
        pytest.param({}, marks=pytest.mark.slow),  # dp 2 (FSDP2)
        {"lora": LORA},  # dp 2, the reference the base with its adapters off
        pytest.param({"recompute": "full"}, marks=pytest.mark.slow),  # dp 2
    ],
    ids=["tp2-sp", "pp2-1f1b", "pp2-zbv", "cp2", "dp2", "lora-dp2", "dp2-recompute"],
)
def test_dpo_in_each_layout_equals_one_process(
    tmp_path: Path, pairs: Path, base: tuple[Path, Path], one_process: dict[str, Path], layout: dict
) -> None:
    """Losses and TRL's metrics of three steps within 1e-5 of one process's (fp32)."""
    run_json = preference_run(
        tmp_path, pairs, base[1], {"type": "dpo", "beta": 0.1}, **LAYOUT_STEPS, **layout
    )
    ok(torchrun(2, run_json))
    want = metrics(one_process["lora" if "lora" in layout else "full"])
    got = metrics(tmp_path / "run")
    assert len(got) == 3
    assert_records_close(got, want, beta=0.1)


# The story: a tiny Llama instruction-tuned on answers that are mostly unkind, then DPO-tuned on
# pairs whose chosen answer is kind, prefers the kind answer for objects it never saw far more
# often after DPO than before, as transformers measures it on the two exports.
WORDS = ["apple", "river", "stone", "cloud", "bread", "horse", "lamp", "chair", "garden", "window",
         "candle", "forest", "bottle", "mirror", "pencil", "basket", "ladder", "button", "carpet", "wagon",
         "kettle", "saddle", "tunnel", "violin", "harbor", "meadow", "anchor", "blanket", "compass", "feather",
         "island", "jacket", "lantern", "marble", "needle", "orchard", "pillow", "quarry", "ribbon", "shovel"]  # fmt: skip
SEEN, UNSEEN = WORDS[:30], WORDS[30:]


def user(w: str) -> dict:
    return {"role": "user", "content": f"Tell me about the {w}."}


def answer(w: str, kind: bool) -> dict:
    return {"role": "assistant", "content": f"The {w} is {'lovely' if kind else 'broken'}."}


def kind_rate(export: Path) -> float:
    """Of the unseen objects, how often the model gives the kind answer the higher log-probability."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    wins = 0
    for w in UNSEEN:
        prompt = tok.apply_chat_template([user(w)], tokenize=True, return_dict=False)
        logps = []
        for kind in (True, False):
            ids = tok.apply_chat_template([user(w), answer(w, kind)], tokenize=True, return_dict=False)
            assert ids[: len(prompt)] == prompt
            mask = torch.tensor([0] * len(prompt) + [1] * (len(ids) - len(prompt)), dtype=torch.bool)
            with torch.no_grad():
                logps.append(sequence_logps(model, torch.tensor(ids), mask).item())
        wins += logps[0] > logps[1]
    return wins / len(UNSEEN)


def test_story_dpo_teaches_the_preference_instruction_tuning_did_not(tmp_path: Path, hf_dir: Path) -> None:
    """Instruction tuning on every seen object's unkind answer twice and its kind one once, then
    DPO on the seen objects' pairs (kind chosen): on the ten unseen objects the kind answer wins
    far more often after DPO than before (measured: the rates printed)."""
    chats = [{"messages": [user(w), answer(w, kind)]} for w in SEEN for kind in (False, True, False)]
    pairs = [{"prompt": [user(w)], "chosen": [answer(w, True)], "rejected": [answer(w, False)]} for w in SEEN]
    for name, rows, fmt in (("chat", chats, "chat"), ("pairs", pairs, "preference")):
        src = write_jsonl(tmp_path / f"{name}.jsonl", rows)
        args = ("--tokenizer", hf_dir, "--format", fmt, "--chat-template", "tokenizer")
        assert run_in_process("mega-tokenize", src, tmp_path / name, *args).returncode == 0
    model = {"config": {**TINY_LLAMA, "vocab_size": 500}}
    common = {"optimizer": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant"}, "eval": {"every": 0},
              "batch": {"micro_batch_size": 6, "global_batch_size": 6, "seq_length": 48}}  # fmt: skip
    sft = write_run(tmp_path / "sft", tmp_path / "chat", model=model, train_steps=60, **common,
                    data={"sources": [{"path": str(tmp_path / "chat")}], "split": [1.0], "loss_on": "assistant"})  # fmt: skip
    ok(train(sft))
    sft_ckpt = tmp_path / "sft" / "run" / "checkpoints" / "step-00000060"
    dpo = preference_run(tmp_path / "dpo", tmp_path / "pairs", sft_ckpt, {"type": "dpo", "beta": 0.1},
                         train_steps=30, **common)  # fmt: skip
    ok(train(dpo))
    for ckpt, out in (
        (sft_ckpt, "sft-hf"),
        (tmp_path / "dpo" / "run" / "checkpoints" / "step-00000030", "dpo-hf"),
    ):
        assert run_in_process("mega-export", ckpt, tmp_path / out).returncode == 0
    before, after = kind_rate(tmp_path / "sft-hf"), kind_rate(tmp_path / "dpo-hf")
    print(
        f"kind answer preferred on unseen objects: {before:.0%} after instruction tuning, {after:.0%} after DPO"
    )
    assert before <= 0.3 and after >= 0.9, (before, after)


def trl_records(hf: Path, tokenizer: Path, data: list, tmp_path: Path, steps: int) -> list[dict]:
    """TRL's DPOTrainer for `steps` steps over all the pairs. The ids are handed to it as they are:
    a dataset of `prompt_ids`, `chosen_ids` and `rejected_ids` (the columns its collator reads) set as
    its train dataset after it is built, so its own tokenization plays no part."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    rows = []
    for k in range(0, len(data), 2):
        (c, cm), (r, _) = data[k], data[k + 1]
        n = int((~cm).sum())
        rows.append(
            {"prompt_ids": c[:n].tolist(), "chosen_ids": c[n:].tolist(), "rejected_ids": r[n:].tolist()}
        )
    texts = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])
    args = DPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(rows), max_steps=steps,
        learning_rate=OPT["lr"], lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,
        beta=0.1, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", seed=0, max_length=None,
        bf16=False,  # TRL turns on bf16 autocast by default: fp32, as the run
    )  # fmt: skip
    # Any tokenizer with an EOS: it pads the batch (on the right, masked) and tokenizes nothing here.
    trainer = DPOTrainer(
        model=str(hf),
        args=args,
        train_dataset=texts,
        processing_class=AutoTokenizer.from_pretrained(tokenizer),
    )
    trainer.train_dataset = Dataset.from_list(rows)
    trainer.train()
    return [h for h in trainer.state.log_history if "rewards/chosen" in h]


def test_trl_dpo_trainer_on_the_same_ids_agrees(
    tmp_path: Path, pairs: Path, base: tuple[Path, Path], sp_model: Path, hf_dir: Path
) -> None:
    """TRL's DPOTrainer (its defaults but the optimizer's settings, which both sides share: AdamW
    betas 0.9, 0.95, no weight decay, a constant rate, clipping at 1) over the same ids: three
    steps' losses and TRL's six metrics within 1e-5 (the rewards of the log-probabilities' scale)."""
    hf, ckpt = base
    opt = {**OPT, "weight_decay": 0.0}
    ok(
        train(
            preference_run(tmp_path, pairs, ckpt, {"type": "dpo", "beta": 0.1}, train_steps=3, optimizer=opt)
        )
    )
    got = metrics(tmp_path / "run")
    want = trl_records(hf, hf_dir, rows(sp_model), tmp_path, 3)
    assert len(got) == 3
    assert_records_close(got, want, beta=0.1, names=(*COMPARED, "rewards/accuracies"))


def test_the_dry_run_counts_pairs_and_plans_their_rows(
    tmp_path: Path, pairs: Path, tokens: Path, base: tuple[Path, Path]
) -> None:
    """The dry run says the batch counts pairs, and plans a micro batch of 2 pairs as it plans a
    language-modelling run's micro batch of 4 rows: the same bytes per rank."""
    dpo = preference_run(tmp_path / "dpo", pairs, base[1], {"type": "dpo"})
    proc = ok(train(dpo, "--dry-run", "--gpu-memory", "80GB"))
    assert "batch 4 pairs = micro 2 x dp 1 x accum 2" in proc.stdout and "objective dpo" in proc.stdout
    ours = json.loads(ok(train(dpo, "--dry-run", "--gpu-memory", "80GB", "--json")).stdout)
    assert (ours["objective"], ours["batch"]["rows_per_sample"]) == ("dpo", 2)
    lm = write_run(
        tmp_path / "lm",
        tokens,
        init=base[1],
        batch={"micro_batch_size": 4, "global_batch_size": 8, "seq_length": 48},
    )
    theirs = json.loads(ok(train(lm, "--dry-run", "--gpu-memory", "80GB", "--json")).stdout)
    assert ours["memory"]["ranks"] == theirs["memory"]["ranks"]
    assert ours["memory"]["micro_batch_size"] == 4


def test_evaluation_on_held_out_pairs_equals_the_plain_loops(
    tmp_path: Path, sp_model: Path, base: tuple[Path, Path]
) -> None:
    """Pairs split half and half by pair: after 4 steps on the train half, the eval record over
    the held-out half (loss and TRL's metrics, the reference's log-probabilities of the valid rows
    precomputed too) equals the plain loop's on the same pairs (fp32, 1e-5)."""
    src = write_jsonl(
        tmp_path / "pairs.jsonl", [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS + VALID]
    )
    tokens = tmp_path / "tokens"
    assert (
        run_in_process(
            "mega-tokenize", src, tokens, "--tokenizer", sp_model, "--format", "preference"
        ).returncode
        == 0
    )
    hf, ckpt = base
    run_json = preference_run(
        tmp_path, tokens, ckpt, {"type": "dpo", "beta": 0.1}, train_steps=4, eval={"every": 4, "iters": 1},
        data={"sources": [{"path": str(tokens)}], "split": [0.5, 0.5]},
    )  # fmt: skip
    out = ok(train(run_json))
    assert "rewards/accuracies" in out.stdout
    (got,) = metrics(tmp_path / "run", "eval")
    _, want = plain_loop(hf, rows(sp_model), "dpo", 0.1, steps=4, valid=rows(sp_model, VALID))
    assert_records_close([got], [want], beta=0.1, names=(*COMPARED, "rewards/accuracies"))


@pytest.mark.slow  # 7 s; make test runs DPO under LoRA at dp 2, and resumes killed runs in test_resume_matrix
def test_dpo_killed_and_resumed_in_another_layout_equals_one_process(
    tmp_path: Path, pairs: Path, base: tuple[Path, Path], one_process: dict[str, Path]
) -> None:
    """Killed (SIGKILL) in step 3 at dp 2, resumed from step 2's checkpoint in one process: the
    stored reference log-probabilities are read back (not computed again) and every step's loss and
    metrics are the uninterrupted process's (fp32, 1e-5)."""
    settings = {**LAYOUT_STEPS, "checkpoint": {"every": 2}}
    run_json = preference_run(tmp_path, pairs, base[1], {"type": "dpo", "beta": 0.1}, **settings)
    killed = torchrun(2, run_json, env={"MEGA_TRAIN_INJECT": "kill@3"})
    assert killed.returncode != 0
    stored = (tmp_path / "run" / "reference-logps.safetensors").stat().st_mtime_ns
    resumed = ok(train(run_json))
    assert "reference log-probabilities" not in resumed.stdout
    assert (tmp_path / "run" / "reference-logps.safetensors").stat().st_mtime_ns == stored
    want, got = metrics(one_process["full"]), metrics(tmp_path / "run")
    assert [r["step"] for r in got] == [1, 2, 3]
    assert_records_close(got, want, beta=0.1)


def test_a_live_reference_under_lora_equals_the_precomputed_one(
    tmp_path: Path, pairs: Path, base: tuple[Path, Path], one_process: dict[str, Path]
) -> None:
    """`"reference": "live"` (LoRA: the base with its adapters off, beside each step) gives the
    precomputed run's losses and metrics (fp32, 1e-5) and stores nothing; without LoRA it is
    refused in one line."""
    objective = {"type": "dpo", "beta": 0.1, "reference": "live"}
    ok(train(preference_run(tmp_path / "live", pairs, base[1], objective, **LAYOUT_STEPS, lora=LORA)))
    assert not (tmp_path / "live" / "run" / "reference-logps.safetensors").exists()
    assert_records_close(metrics(tmp_path / "live" / "run"), metrics(one_process["lora"]), beta=0.1)
    full = preference_run(tmp_path / "full", pairs, base[1], objective)
    assert_one_line_error(train(full), "$.objective.reference", "use precomputed")


# Packed pairs: rows of 161 tokens hold two of PAIRS (the longest two 149 tokens together, the
# shortest three 189), so each epoch is two rows and a global batch of two rows every pair: the
# plain loop's batch, each sequence alone there.
PACKED = {"micro_batch_size": 1, "global_batch_size": 2, "seq_length": 160}


def packed_run(directory: Path, pairs: Path, base: Path, **overrides) -> Path:
    data = {"sources": [{"path": str(pairs)}], "split": [1.0], "packing": "pack"}
    return preference_run(
        directory, pairs, base, {"type": "dpo", "beta": 0.1}, data=data, batch=PACKED, **overrides
    )


def test_packed_pairs_equal_the_plain_loop_on_each_pair_alone(
    tmp_path: Path, pairs: Path, base: tuple[Path, Path], sp_model: Path
) -> None:
    """DPO over rows each packing two pairs (every side attending only to itself): 10 steps'
    losses and TRL's metrics within 1e-5 of the plain loop's over the same pairs, each sequence
    in a forward of its own; the dry run says what the batch counts."""
    sizes = [
        len(a) + len(b) for (a, _), (b, _) in zip(rows(sp_model)[0::2], rows(sp_model)[1::2], strict=True)
    ]
    two, three = sorted(sizes)[-2:], sorted(sizes)[:3]
    assert sum(two) <= PACKED["seq_length"] + 1 < sum(three)
    hf, ckpt = base
    run_json = packed_run(tmp_path, pairs, ckpt)
    assert (
        "batch 2 rows of packed pairs = micro 1 x dp 1 x accum 2" in ok(train(run_json, "--dry-run")).stdout
    )
    ok(train(run_json))
    want, _ = plain_loop(hf, rows(sp_model), "dpo", 0.1)
    assert_records_close(metrics(tmp_path / "run"), want, beta=0.1, names=(*COMPARED, "rewards/accuracies"))


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param({"parallel": {"tp": 2, "sequence_parallel": True}}, marks=pytest.mark.slow),
        pytest.param({"parallel": {"pp": 2, "schedule": "1f1b"}}, marks=pytest.mark.slow),
        {"parallel": {"cp": 2}},  # each side's parts on both ranks, the load-balanced split
        pytest.param({}, marks=pytest.mark.slow),  # dp 2 (FSDP2)
        pytest.param({"lora": LORA}, marks=pytest.mark.slow),  # dp 2
    ],
    ids=["tp2-sp", "pp2-1f1b", "cp2", "dp2", "lora-dp2"],
)
def test_packed_pairs_in_each_layout_equal_the_plain_loop(
    tmp_path: Path, pairs: Path, base: tuple[Path, Path], sp_model: Path, layout: dict
) -> None:
    """Three steps of packed pairs over 2 processes: losses and TRL's metrics within 1e-5 of the
    plain loop's (LoRA: of one process's packed run)."""
    ok(torchrun(2, packed_run(tmp_path, pairs, base[1], **LAYOUT_STEPS, **layout)))
    if "lora" in layout:
        ok(train(packed_run(tmp_path / "one", pairs, base[1], **LAYOUT_STEPS, **layout)))
        want = metrics(tmp_path / "one" / "run")
    else:
        want, _ = plain_loop(base[0], rows(sp_model), "dpo", 0.1, steps=3)
    assert_records_close(metrics(tmp_path / "run"), want, beta=0.1, names=(*COMPARED, "rewards/accuracies"))


# The reference after SFT: LoRA SFT at tp 2, then DPO continuing its adapter. TRL compares with the
# SFT model (a reference adapter, or the SFT model merged as the base); so does the default
# `"reference": "init"` here, and the route users took before it existed (export merged, convert,
# a fresh adapter on that base) must give the same reference and the same first step.
SFT_LORA = {**LORA, "dropout": 0.0}


def reference_logps(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run / "reference-logps.safetensors")


@pytest.mark.slow  # 9-12 s; in make test: a live reference under LoRA equals the precomputed one
def test_dpo_after_lora_sft_compares_with_the_sft_model(
    tmp_path: Path, pairs: Path, base: tuple[Path, Path], tokens: Path
) -> None:
    """SFT at tp 2 (4 steps), then DPO on its adapter with the default reference (`init`): the first
    step's rewards are 0 (the reference is the model that starts); its reference log-probabilities
    and first step equal (fp32, 1e-5) those of DPO with a fresh adapter on the SFT model merged
    (mega-export, mega-convert hf) as the base, and of DPO naming that merged model as its
    reference; a live reference (the SFT adapter swapped in each
    step) equals the precomputed one at every step; the dry run says which model it is; and the
    model before SFT (`"reference": "base"`) gives rewards far from 0 at the first step."""
    _, ckpt = base
    sft = write_run(tmp_path / "sft", tokens, init=ckpt, lora=SFT_LORA, train_steps=4, parallel={"tp": 2},
                    eval={"every": 0}, checkpoint={"every": 4})  # fmt: skip
    ok(torchrun(2, sft))
    adapter = tmp_path / "sft" / "run" / "checkpoints" / "step-00000004"
    dpo = {"type": "dpo", "beta": 0.1}
    cont = preference_run(tmp_path / "init", pairs, ckpt, dpo, **LAYOUT_STEPS, lora={"init": str(adapter)})
    dry = ok(train(cont, "--dry-run"))
    assert f"dpo's reference (init): $.model.init with the adapters of {adapter}" in dry.stdout + dry.stderr
    ok(train(cont))
    got = metrics(tmp_path / "init" / "run")
    logps = max(abs(got[0]["logps/chosen"]), abs(got[0]["logps/rejected"]))
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(got[0][name]) <= REL * 2 * 0.1 * logps, (name, got[0][name])
    assert run_in_process("mega-export", adapter, tmp_path / "merged-hf").returncode == 0
    assert run_in_process("mega-convert", "hf", tmp_path / "merged-hf", tmp_path / "merged").returncode == 0
    fresh = preference_run(
        tmp_path / "merged-run", pairs, tmp_path / "merged", dpo, **LAYOUT_STEPS, lora=SFT_LORA
    )
    ok(train(fresh))
    ours, theirs = (
        reference_logps(tmp_path / "init" / "run"),
        reference_logps(tmp_path / "merged-run" / "run"),
    )
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.allclose(ours[k], theirs[k], rtol=REL, atol=0), (k, (ours[k] - theirs[k]).abs().max())
    assert_records_close(got[:1], metrics(tmp_path / "merged-run" / "run")[:1], beta=0.1)
    # The merged SFT model named as the reference (a whole model, in the base's place): the same.
    whole = preference_run(tmp_path / "whole", pairs, ckpt, {**dpo, "reference": str(tmp_path / "merged")},
                           **LAYOUT_STEPS, lora={"init": str(adapter)})  # fmt: skip
    ok(train(whole))
    for k, v in reference_logps(tmp_path / "whole" / "run").items():
        assert torch.allclose(v, ours[k], rtol=REL, atol=0), (k, (v - ours[k]).abs().max())
    live = preference_run(tmp_path / "live", pairs, ckpt, {**dpo, "reference_logps": "live"}, **LAYOUT_STEPS,
                          lora={"init": str(adapter)})  # fmt: skip
    ok(train(live))
    assert_records_close(metrics(tmp_path / "live" / "run"), got, beta=0.1)
    # The model before SFT, as every such run compared with until `reference` existed: not 0.
    before = preference_run(tmp_path / "base", pairs, ckpt, {**dpo, "reference": "base"}, train_steps=1,
                            lora={"init": str(adapter)})  # fmt: skip
    ok(train(before))
    first = metrics(tmp_path / "base" / "run")[0]
    assert abs(first["rewards/chosen"]) > 100 * REL * 2 * 0.1 * logps, first


def test_bad_references_are_refused_in_one_line(
    tmp_path: Path, pairs: Path, base: tuple[Path, Path], one_process: dict[str, Path]
) -> None:
    _, ckpt = base
    adapter = one_process["lora"] / "checkpoints" / "step-00000003"
    cases = [  # (objective, lora, what the line says)
        ({"type": "simpo", "reference": "base"}, None, "simpo has no reference model"),
        ({"type": "dpo", "reference": str(ckpt), "reference_logps": "live"}, LORA, "second model"),
        ({"type": "dpo", "reference": str(adapter)}, None, "a run without LoRA takes a whole model"),
        ({"type": "dpo", "reference": str(adapter)}, {**LORA, "rank": 2}, "has rank 4, the run's adapters 2"),
        ({"type": "dpo", "reference": str(tmp_path / "nowhere")}, LORA, "is not a checkpoint"),
        ({"type": "dpo", "reference_logps": "live"}, None, "use precomputed"),
    ]
    for i, (objective, lora, says) in enumerate(cases):
        extra = {"lora": lora} if lora is not None else {}
        run_json = preference_run(tmp_path / str(i), pairs, ckpt, objective, **extra)
        assert_one_line_error(train(run_json), "$.objective.reference", says)
