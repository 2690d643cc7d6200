"""Online RL (`objective` grpo) in a run: its steps against a plain PyTorch loop over transformers
written from the formulas (`grpo_formulas`), handed the completions the run sampled (its `rollout`
records); the dry run's batch line; bad settings refused in one line; prompts refused by the
objectives that learn the documents they read."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from grpo_formulas import formula_loss
from helpers import assert_bitwise_equal, assert_one_line_error, run_in_process, run_tool
from hf_cases import build, load_hf
from megacore.models.grpo import Clip
from runlib import LOSS_REL, checkpoint_tensors, metrics, ok, torchrun, train, write_run
from tokenize_testlib import write_jsonl

OPT = {"lr": 2e-3, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.1, "grad_clip": 1.0}
REL = 1e-5
G, P, LENGTH, STEPS = 4, 2, 8, 4
# A reward that tells random completions apart: the share of their ids divisible by 3.
REWARD_FILE = "def thirds(completions, completion_ids, **_):\n    return [sum(i % 3 == 0 for i in c) / len(c) for c in completion_ids]\n"


@pytest.fixture(scope="module")
def prompts(tmp_path_factory, sp_model: Path) -> Path:
    root = tmp_path_factory.mktemp("prompts")
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    out = root / "tokens"
    run_tool("mega-tokenize", write_jsonl(root / "p.jsonl", rows), out, "-t", sp_model, "--format", "prompts",
             check=True)  # fmt: skip
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random Llama as transformers saves it, and converted: (HF directory, checkpoint)."""
    root = tmp_path_factory.mktemp("grpo-base")
    hf = build("llama", root / "hf", vocab_size=400, num_hidden_layers=2, max_position_embeddings=256)
    assert run_in_process("mega-convert", "hf", hf, root / "base").returncode == 0
    return hf, root / "base"


def grpo_run(directory: Path, prompts: Path, base: Path, objective: dict, **overrides) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "rewards.py").write_text(REWARD_FILE)
    spec = {
        "type": "grpo",
        "num_generations": G,
        "max_completion_length": LENGTH,
        "temperature": 0.9,
        "rewards": [{"function": "rewards.py:thirds"}, {"function": "exact", "weight": 0.5}],
        **objective,
    }
    settings = {
        "train_steps": STEPS, "optimizer": OPT, "eval": {"every": 0}, "checkpoint": {"every": 100},
        "data": {"sources": [{"path": str(prompts)}], "split": [1.0]},
        "batch": {"micro_batch_size": 1, "global_batch_size": P, "seq_length": 24},
    }  # fmt: skip
    return write_run(directory, prompts, init=base, objective=spec, **{**settings, **overrides})


def _advantages(rows: list[dict], weights: dict[str, float]) -> torch.Tensor:
    """Each group's rewards, less their mean, over their (unbiased) std + 1e-4."""
    rewards = torch.tensor(
        [sum(weights[k] * v for k, v in r["rewards"].items() if v is not None) for r in rows]
    )
    groups = rewards.view(-1, G)
    mean, std = groups.mean(1, keepdim=True), groups.std(1, keepdim=True)
    return ((groups - mean) / (std + 1e-4)).reshape(-1)


def _logps(model, sp, rows: list[dict], temperature: float, entropy: list | None = None) -> torch.Tensor:
    """[N, LENGTH] each completion token's log-probability after its prompt (0 past its end); the
    entropy at each completion token appended to `entropy`."""
    out = torch.zeros(len(rows), LENGTH)
    for i, r in enumerate(rows):
        p, c = sp.encode(r["prompt"]), r["completion_ids"]
        logits = (
            model(torch.tensor([p + c])).logits[0, len(p) - 1 : len(p) - 1 + len(c)].float() / temperature
        )
        logp = torch.log_softmax(logits, -1)
        out[i, : len(c)] = logp.gather(1, torch.tensor(c)[:, None])[:, 0]
        if entropy is not None:
            entropy += (-(logp.exp() * logp).sum(-1)).tolist()
    return out


def plain_loop(hf: Path, sp, rollouts: dict[int, list[dict]], spec: dict) -> list[dict]:
    """AdamW steps (mega-train's settings) on the run's completions, from the formulas: each step's
    loss, gradient norm (before clipping), KL and clip ratios."""
    policy, reference = load_hf(hf).train(), load_hf(hf)
    params = list(policy.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]  # fmt: skip
    opt = torch.optim.AdamW(groups, lr=OPT["lr"], betas=(0.9, 0.95), eps=1e-8)
    clip = Clip(epsilon_high=spec.get("epsilon_high", 0.2), beta=spec.get("beta", 0.0),
                sequence_level=spec.get("importance_sampling_level") == "sequence")  # fmt: skip
    weights, T, records = {"rewards.py:thirds": 1.0, "exact": 0.5}, spec["temperature"], []
    for step in range(1, STEPS + 1):
        first = step - (step - 1) % spec["num_iterations"]  # the step whose rollout this step trains on
        rows = rollouts[first]
        lengths = [len(r["completion_ids"]) for r in rows]
        with torch.no_grad():
            if step == first:
                old, ref = _logps(policy, sp, rows, T), _logps(reference, sp, rows, T)
        entropy: list[float] = []
        logps = _logps(policy, sp, rows, T, entropy)
        adv = _advantages(rows, weights)
        loss = formula_loss(logps, old, ref, adv, lengths, spec["loss"], clip, LENGTH)
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, OPT["grad_clip"])
        opt.step()
        with torch.no_grad():
            mask = torch.arange(LENGTH)[None] < torch.tensor(lengths)[:, None]
            log_ratio = logps - old
            if clip.sequence_level:  # one ratio a completion: its tokens' mean log-ratio
                log_ratio = ((log_ratio * mask).sum(1) / mask.sum(1))[:, None].expand_as(logps)
            rho = torch.exp(log_ratio)
            kl = (torch.exp(ref - logps) - (ref - logps) - 1) * rho
            low = ((rho < 0.8) & (adv[:, None] < 0) & mask).sum() / mask.sum()
        records.append({"loss": loss.item(), "grad_norm": norm.item(), "kl": (kl[mask].mean()).item(),
                        "entropy": sum(entropy) / len(entropy), "clip_ratio/low_mean": low.item(),
                        "advantages": adv.tolist()})  # fmt: skip
    return records


CASES = {
    "grpo-mu2-beta": {"loss": "grpo", "num_iterations": 2, "beta": 0.04},
    "dapo": {"loss": "dapo"},
    "dr_grpo-beta": {"loss": "dr_grpo", "beta": 0.04},
    "bnpo-mu2": {"loss": "bnpo", "num_iterations": 2},
    # GSPO's sequence-level ratios, with DAPO's clip-higher
    "sequence-clip-higher": {"loss": "grpo", "importance_sampling_level": "sequence", "num_iterations": 2,
                             "epsilon_high": 0.28, "beta": 0.04},
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_steps_equal_the_formulas_over_transformers(tmp_path: Path, prompts: Path, base: tuple[Path, Path],
                                                    sp_model: Path, case: str) -> None:  # fmt: skip
    """Each step's loss, gradient norm, KL, entropy and clip ratio within 1e-5 of the plain loop's on the
    completions the run sampled (fp32), every rollout's advantages the formula's, and the rollout
    metrics TRL's."""
    hf, ckpt = base
    spec = {"temperature": 0.9, "num_iterations": 1, **CASES[case]}
    # Evaluation every 2 steps on held-out prompts: its own seeds, so the training is as without it.
    held_out = {
        "data": {"sources": [{"path": str(prompts)}], "split": [0.9, 0.1]},
        "eval": {"every": 2, "iters": 1},
    }
    run = grpo_run(tmp_path, prompts, ckpt, spec, **held_out)
    ok(train(run))
    out = tmp_path / "run"
    evals = metrics(out, "eval")
    assert [r["step"] for r in evals] == [2, 4] and all(0 <= r["reward"] <= 1.5 for r in evals), evals
    assert {"rewards/exact/mean", "rewards/rewards.py:thirds/mean"} <= set(evals[0]), evals[0]
    rollouts: dict[int, list[dict]] = {}
    for r in metrics(out, "rollout"):
        rollouts.setdefault(r["step"], []).append(r)
    assert sorted(rollouts) == list(range(1, STEPS + 1, spec["num_iterations"]))
    assert all(len(rows) == P * G for rows in rollouts.values())
    want = plain_loop(hf, spm.SentencePieceProcessor(model_file=str(sp_model)), rollouts, spec)
    got = metrics(out)
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=1):
        for name in (
            "loss",
            "grad_norm",
            "entropy",
            "clip_ratio/low_mean",
            *(("kl",) if spec.get("beta") else ()),
        ):
            assert math.isclose(g[name], w[name], rel_tol=REL, abs_tol=1e-7), (step, name, g[name], w[name])
        if step in rollouts:
            assert torch.allclose(torch.tensor([r["advantage"] for r in rollouts[step]]), torch.tensor(w["advantages"]),
                                  rtol=1e-5, atol=1e-6)  # fmt: skip
            rewards = torch.tensor([r["reward"] for r in rollouts[step]], dtype=torch.float64)
            assert math.isclose(g["reward"], rewards.mean().item(), rel_tol=1e-9)
            assert math.isclose(g["reward_std"], rewards.std().item(), rel_tol=1e-9)
            lengths = [len(r["completion_ids"]) for r in rollouts[step]]
            assert g["completions/mean_length"] == sum(lengths) / len(lengths)
    for g in got:  # the step's time split: a rollout's sampling and scoring, then the training
        rolled = g["step"] in rollouts
        assert (g["time/generation_s"] > 0) == (g["time/scoring_s"] > 0) == rolled, g
        parts = g["time/generation_s"] + g["time/scoring_s"] + g["time/training_s"]
        assert g["time/training_s"] > 0 and parts <= g["step_time_s"] + 1e-3, g
    # The clip ratio and KL compared are not all 0, but where neither can be (one update a batch,
    # no beta: the ratio is 1 and the KL not reported).
    compared = [w["clip_ratio/low_mean"] for w in want] + [w["kl"] for w in want if spec.get("beta")]
    assert max(compared) > 0 or (spec["num_iterations"] == 1 and not spec.get("beta"))


LORA = {
    "rank": 4,
    "alpha": 8,
    "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
LAYOUT = {"loss": "dapo", "beta": 0.04, "num_iterations": 2}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, prompts: Path, base: tuple[Path, Path]) -> dict[str, Path]:
    """Four steps in one process, full and LoRA (its reference the base, adapters off)."""
    out = {}
    for name, extra in (("full", {}), ("lora", {"lora": LORA})):
        d = tmp_path_factory.mktemp(f"grpo-one-{name}")
        ok(train(grpo_run(d, prompts, base[1], LAYOUT, **extra)))
        out[name] = d / "run"
    return out


@pytest.mark.parametrize(
    "layout",
    [
        # `make test-slow` (make test runs the sampler at tp 2 in test_harness, and GRPO's steps
        # against the formulas in one process here)
        pytest.param({"parallel": {"tp": 2}}, marks=pytest.mark.slow),
        pytest.param({"parallel": {"pp": 2}}, marks=pytest.mark.slow),  # sampled stage by stage
        pytest.param({}, marks=pytest.mark.slow),  # dp 2 (FSDP2)
        pytest.param({"lora": LORA}, marks=pytest.mark.slow),  # dp 2, the reference the base
    ],
    ids=["tp2", "pp2", "dp2", "lora-dp2"],
)
def test_every_layout_samples_and_trains_as_one_process(
    tmp_path: Path, prompts: Path, base: tuple[Path, Path], one_process: dict[str, Path], layout: dict
) -> None:
    """The same completions (ids) and rewards, and every step's loss, gradient norm, KL and reward
    within LOSS_REL of one process's (fp32)."""
    ok(torchrun(2, grpo_run(tmp_path, prompts, base[1], LAYOUT, **layout)))
    assert_same_run(tmp_path / "run", one_process["lora" if "lora" in layout else "full"])


def assert_same_run(got_dir: Path, want_dir: Path) -> None:
    keys = ("prompt", "completion_ids", "rewards")
    assert [[r[k] for k in keys] for r in metrics(got_dir, "rollout")] == [
        [r[k] for k in keys] for r in metrics(want_dir, "rollout")
    ]
    got, want = metrics(got_dir), metrics(want_dir)
    assert len(got) == len(want) == STEPS
    for g, w in zip(got, want, strict=True):
        for name in ("loss", "grad_norm", "kl", "entropy", "reward", "clip_ratio/region_mean"):
            assert math.isclose(g[name], w[name], rel_tol=LOSS_REL, abs_tol=1e-7), (g["step"], name)


@pytest.mark.slow  # 10 s of 2 runs; make test checks GRPO's steps against the formulas in one process
def test_experts_split_over_ep_sample_and_train_as_one_process(
    tmp_path: Path, prompts: Path, tmp_path_factory
) -> None:
    """A Mixtral of 4 experts at ep 2 (each of the 2 ranks holding 2): the same completions, rewards
    and steps as one process."""
    root = tmp_path_factory.mktemp("grpo-mixtral")
    hf = build("mixtral", root / "hf", vocab_size=400, num_hidden_layers=2, max_position_embeddings=256,
               num_local_experts=4)  # fmt: skip
    assert run_in_process("mega-convert", "hf", hf, root / "base").returncode == 0
    ok(train(grpo_run(tmp_path / "one", prompts, root / "base", LAYOUT)))
    ok(torchrun(2, grpo_run(tmp_path / "ep2", prompts, root / "base", LAYOUT, parallel={"ep": 2})))
    assert_same_run(tmp_path / "ep2" / "run", tmp_path / "one" / "run")


@pytest.mark.slow  # make test resumes a killed run in test_resume_matrix (fp16)
@pytest.mark.parametrize("nproc", [1, 2], ids=["same-layout", "dp2"])
def test_a_killed_run_resumes_to_the_same_completions_and_weights(
    tmp_path: Path, prompts: Path, base: tuple[Path, Path], nproc: int
) -> None:
    """Killed after step 3's backward (SIGKILL), resumed from step 2's checkpoint in one process or
    at dp 2: the same completions (seeded by batch), rewards and losses as an uninterrupted run, and
    the same weights (bitwise in the same layout, within LOSS_REL at dp 2)."""
    common = {"checkpoint": {"every": 2}}
    reference = grpo_run(tmp_path / "reference", prompts, base[1], {}, **common)
    ok(train(reference, fresh=True))
    run = grpo_run(tmp_path / "killed", prompts, base[1], {}, **common)
    killed = run_tool("mega-train", "--manifest", run, env={"MEGA_TRAIN_INJECT": "kill@3"})
    assert killed.returncode != 0
    ok(torchrun(2, run) if nproc == 2 else train(run, fresh=True))
    keys = ("step", "prompt", "completion_ids", "rewards")
    rollouts = [[r[k] for k in keys] for r in metrics(tmp_path / "killed" / "run", "rollout")]
    assert rollouts == [[r[k] for k in keys] for r in metrics(tmp_path / "reference" / "run", "rollout")]
    got, want = metrics(tmp_path / "killed" / "run"), metrics(tmp_path / "reference" / "run")
    for g, w in zip(got, want, strict=True):
        for name in ("loss", "grad_norm", "reward"):
            assert math.isclose(g[name], w[name], rel_tol=0 if nproc == 1 else LOSS_REL, abs_tol=1e-7), name
    last = f"step-{STEPS:08d}"
    want_t = checkpoint_tensors(tmp_path / "reference" / "run" / "checkpoints" / last)
    got_t = checkpoint_tensors(tmp_path / "killed" / "run" / "checkpoints" / last)
    for name, w in want_t.items():
        if nproc == 1:
            assert_bitwise_equal(got_t[name], w, name)
        else:
            assert torch.allclose(got_t[name].float(), w.float(), rtol=1e-4, atol=1e-6), name


def test_the_dry_run_counts_prompts_and_their_completions(tmp_path: Path, prompts: Path, base) -> None:
    run = grpo_run(tmp_path, prompts, base[1], {})
    out = ok(train(run, "--dry-run")).stdout
    assert f"batch {P} prompts x {G} completions = micro 1 x dp 1 x accum {P}" in out
    assert (
        "grpo: 4 completions a prompt, up to 8 tokens at temperature 0.9; loss dapo; rewards rewards.py:thirds x 1, exact x 0.5"
        in out
    )
    assert f"rollout: a KV cache of {P * G} rows x 24 positions" in out
    # The rollout's KV cache: every completion of the batch, seq_length positions, each layer's k and
    # v of its kv heads in fp32, from the model's config.json.
    hf = json.loads((base[0] / "config.json").read_text())
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    per_layer = 2 * P * G * 24 * hf["num_key_value_heads"] * head_dim * 4
    memory = json.loads(ok(train(run, "--dry-run", "--json")).stdout)["memory"]
    assert memory["rollout"]["cache"] == hf["num_hidden_layers"] * per_layer
    assert memory["peak"] >= memory["rollout"]["peak"] > memory["rollout"]["cache"]


@pytest.mark.parametrize(
    ("objective", "overrides", "message"),
    [
        ({"num_generations": 1}, {}, "num_generations"),
        ({"epsilon": 0}, {}, "epsilon"),
        ({"rewards": [{"function": "nope"}]}, {}, "'nope' is neither a built-in"),
        ({"rewards": [{"function": "rewards.py:missing"}]}, {}, "missing"),
        (
            {"loss": "sigmoid"},
            {},
            "$.objective.loss: grpo takes grpo or dapo or bnpo or dr_grpo, not sigmoid",
        ),
        ({}, {"parallel": {"cp": 2}}, "$.parallel.cp: grpo samples its completions with the sampler"),
        ({"max_completion_length": 24}, {}, "$.batch.seq_length: a row holds a prompt and its completion"),
    ],
    ids=["one-generation", "epsilon", "unknown-reward", "missing-function", "pair-loss", "cp", "no-room"],
)
def test_bad_settings_are_refused_in_one_line(
    tmp_path: Path, prompts: Path, base, objective, overrides, message
):
    assert_one_line_error(
        train(grpo_run(tmp_path, prompts, base[1], objective, **overrides), "--dry-run"), message
    )


FLAKY = """from pathlib import Path


def flaky(completions, **_):
    mark = Path(__file__).with_name("called")
    if mark.exists():
        raise ValueError("no score for this one")
    mark.touch()
    return [0.0] * len(completions)
"""


def test_a_reward_that_raises_stops_the_run_after_a_save(tmp_path: Path, prompts: Path, base) -> None:
    """The second batch's scoring raises: one line naming the function and the row, exit 2, and
    the first step's checkpoint saved."""
    run = grpo_run(tmp_path, prompts, base[1], {"rewards": [{"function": "rewards.py:flaky"}]})
    (tmp_path / "rewards.py").write_text(FLAKY)
    assert_one_line_error(train(run), "$.objective.rewards", "rewards.py:flaky", "no score for this one",
                          "(step 1 saved)")  # fmt: skip
    assert (tmp_path / "run" / "checkpoints" / "step-00000001" / "manifest.json").is_file()


def test_text_tokens_are_refused_by_grpo(tmp_path: Path, tokens: Path, base) -> None:
    run = grpo_run(tmp_path, tokens, base[1], {}, data={"sources": [{"path": str(tokens)}], "split": [1.0]})
    assert_one_line_error(train(run, "--dry-run"), "$.objective.type grpo samples completions of prompts",
                          "--format prompts")  # fmt: skip


@pytest.mark.parametrize("objective", ["lm", "distill"])
def test_prompts_are_refused_by_objectives_that_read_documents(tmp_path: Path, prompts: Path, objective: str):
    spec = {"type": objective} if objective == "lm" else {"type": objective, "teacher": str(tmp_path)}
    run = write_run(tmp_path, prompts, objective=spec)
    assert_one_line_error(train(run, "--dry-run"), "holds prompts (mega-tokenize --format prompts)",
                          f"$.objective.type {objective} does not train on")  # fmt: skip
