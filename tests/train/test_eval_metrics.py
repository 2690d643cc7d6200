"""mega-train evaluation and W&B: the eval record's loss, perplexity and next-token accuracy against a
hand computation, a user metric by import path combined over dp ranks, a bad metric path refused at
start-up, and W&B in offline mode for real (history read back from its `.wandb` file, a resumed run
continuing the same W&B run, the API key nowhere)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_one_line_error, load_decoder
from mega_train.evaluation import EvalSums
from mega_train.metrics import perplexity
from mega_train.run_plan import plan_run
from megacore.config import ModelConfig
from megacore.data.dataset import Dataset
from megacore.models import Decoder
from megacore.parallel.engine import ParallelModel
from megacore.parallel.layout import Parallelism
from megacore.parallel.mesh import build_mesh, shutdown
from runlib import metrics, ok, torchrun, train, wandb_history, write_run

# A user metric module: the mean logit of the even targets, and the share of even targets. Their
# counts differ between batches and ranks, so a mean of per-rank means would not be the value.
METRICS_MODULE = """
def even_targets(logits, targets, mask):
    even = (targets % 2 == 0) & mask
    picked = logits.float().gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return {
        "even_target_logit": (float(picked[even].sum()), float(even.sum())),
        "even_share": (float(even.sum()), float(mask.sum())),
    }

not_a_function = 3
"""


def test_evaluate_matches_a_hand_computation(monkeypatch) -> None:
    """One process, two microbatches, a vocab padded 60 -> 64: the logits the metrics see are the
    model's over the 60 real columns, and loss, perplexity and accuracy are computed by hand."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # a one-process group of its own
        monkeypatch.delenv(var, raising=False)
    config = ModelConfig(
        family="llama", vocab_size=60, padded_vocab_size=64, hidden_size=32, num_layers=2,
        num_heads=4, num_kv_heads=2, ffn_hidden_size=64, max_seq_len=16,
    )  # fmt: skip
    rows = torch.randint(0, config.vocab_size, (4, 13), generator=torch.Generator().manual_seed(0))
    tokens, targets = rows[:, :-1], rows[:, 1:]
    ref = Decoder(config, attention="sdpa")
    ref.init_weights(seed=5)
    with torch.no_grad():
        logits = ref(tokens)[..., : config.vocab_size]
    want_loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), targets.reshape(-1))
    want_acc = (logits.argmax(-1) == targets).float().mean()
    try:
        par = Parallelism(precision="fp32", microbatches=2, attention="sdpa")
        pm = ParallelModel(config, par, build_mesh(), "cpu")
        pm.init_weights(seed=5)
        seen: list[torch.Tensor] = []
        sums = EvalSums([], [], "run.json")

        def on_logits(lg: torch.Tensor, tg: torch.Tensor) -> None:
            seen.append(lg)
            sums.add_logits(lg, tg)

        loss = pm.evaluate(tokens, targets, on_logits)
        sums.add_loss(float(loss), targets.numel())
        got = sums.combine()
    finally:
        shutdown()
    assert [tuple(t.shape) for t in seen] == [(2, 12, 60), (2, 12, 60)]
    torch.testing.assert_close(torch.cat(seen), logits, rtol=1e-5, atol=1e-5)
    assert got.keys() == {"loss", "accuracy"}
    assert got["loss"] == pytest.approx(float(want_loss), rel=1e-5)
    assert perplexity(got["loss"]) == pytest.approx(math.exp(float(want_loss)), rel=1e-5)
    assert got["accuracy"] == pytest.approx(float(want_acc), abs=1e-9)


@pytest.mark.slow  # 8 s; make test checks the evaluation against a hand computation in one process
def test_user_metric_is_combined_over_dp2(tmp_path: Path, tokens: Path, monkeypatch) -> None:
    """dp2 (FSDP2), eval every 3 of 4 steps (and at the end): the user metric, loss and accuracy in
    each eval record equal a hand computation over the same valid batches with the checkpoint's
    weights; no W&B without a project."""
    (tmp_path / "mymetrics.py").write_text(METRICS_MODULE)
    run_json = write_run(
        tmp_path, tokens, train_steps=4, batch={"micro_batch_size": 4},
        eval={"every": 3, "iters": 2, "metrics": ["mymetrics:even_targets"]}, checkpoint={"every": 3},
    )  # fmt: skip
    proc = ok(torchrun(2, run_json, env={"PYTHONPATH": str(tmp_path)}))
    out = tmp_path / "run"
    rows = metrics(out, "eval")
    assert [r["step"] for r in rows] == [3, 4]
    assert list(rows[0]) == ["step", "kind", "loss", "ppl", "accuracy", "even_target_logit", "even_share"]
    assert "step 4 eval | loss" in proc.stdout and "even_share" in proc.stdout
    assert not (out / "wandb").exists() and not (out / "wandb-run-id").exists()

    monkeypatch.syspath_prepend(tmp_path)  # the plan imports the metric module
    plan = plan_run(run_json, 2)
    run = plan.run
    G, S = run.batch.global_batch_size, run.batch.seq_length
    valid = Dataset.build(
        plan.data, run.data.split, "valid", S, run.eval.iters * G, run.seed, out / "data-index"
    )
    batches = [torch.from_numpy(valid.batch(k * G, (k + 1) * G)[0]).long() for k in range(run.eval.iters)]
    x = torch.cat([b[:, :-1] for b in batches])
    y = torch.cat([b[:, 1:] for b in batches])
    for record in rows:
        model = load_decoder(out / "checkpoints" / f"step-{record['step']:08d}")  # auto: SDPA on a CPU
        with torch.no_grad():
            logits = model(x)[..., : plan.config.vocab_size]
        even = y % 2 == 0
        picked = logits.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        assert record["loss"] == pytest.approx(float(loss), rel=1e-4)
        assert record["ppl"] == pytest.approx(math.exp(record["loss"]))
        # an argmax may flip on a near tie between layouts: one token at most
        assert record["accuracy"] == pytest.approx(
            float((logits.argmax(-1) == y).float().mean()), abs=1.5 / y.numel()
        )
        assert record["even_target_logit"] == pytest.approx(float(picked[even].mean()), rel=1e-4)
        assert record["even_share"] == float(even.sum()) / y.numel()


@pytest.mark.parametrize(
    "path, fragments",
    [
        ("nowhere_such_module:fn", ["cannot import module 'nowhere_such_module'", "ModuleNotFoundError"]),
        ("mymetrics:missing", ["module 'mymetrics' has no attribute 'missing'"]),
        ("mymetrics:not_a_function", ["'mymetrics:not_a_function' is not callable (a int)"]),
        ("mymetrics", ["is not an import path `module:function`"]),
    ],
)
def test_bad_metric_path_exits_2_with_one_line(
    tmp_path: Path, tokens: Path, path: str, fragments: list
) -> None:
    (tmp_path / "mymetrics.py").write_text(METRICS_MODULE)
    run_json = write_run(
        tmp_path, tokens, eval={"every": 6, "iters": 2, "metrics": ["mymetrics:even_targets", path]}
    )
    proc = train(run_json, env={"PYTHONPATH": str(tmp_path)})
    assert_one_line_error(proc, "$.eval.metrics[1]: ", *fragments)
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_wandb_offline_run_is_continued_on_resume(tmp_path: Path, tokens: Path) -> None:
    """Offline W&B with a (fake) API key in the environment: 4 steps, then the same run extended to 6
    resumes from its step-4 checkpoint and logs to the same W&B run id; every train and eval record
    is in the history at its step; the key is in no output and no file of the run directory."""
    key = "fake0key0" + "5d41402abc4b2a76b9719d911017c592"
    env = {"WANDB_API_KEY": key, "WANDB_MODE": "offline"}
    logging = {"every": 1, "wandb_project": "mega-test", "wandb_mode": "offline"}
    eval_ = {"every": 2, "iters": 1}
    run_json = write_run(tmp_path, tokens, train_steps=4, logging=logging, eval=eval_)
    first = ok(train(run_json, env=env))
    run_json = write_run(tmp_path, tokens, train_steps=6, logging=logging, eval=eval_)
    second = ok(train(run_json, env=env))
    assert "resuming from" in second.stdout
    out = tmp_path / "run"
    run_id = (out / "wandb-run-id").read_text().strip()
    files = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2, files
    histories = [wandb_history(f) for f in files]
    assert [h[0] for h in histories] == [run_id, run_id]
    assert sorted(histories[0][1]) == [1, 2, 3, 4] and sorted(histories[1][1]) == [5, 6]
    logged = {**histories[0][1], **histories[1][1]}
    for record in metrics(out) + metrics(out, "eval"):
        row = logged[record["step"]]
        for field in (
            ("loss", "lr", "grad_norm") if record["kind"] == "train" else ("loss", "ppl", "accuracy")
        ):
            assert row[f"{record['kind']}/{field}"] == pytest.approx(record[field], rel=1e-12), (record, row)
    assert sorted(r["step"] for r in metrics(out, "eval")) == [2, 4, 6]

    for proc in (first, second):
        assert key not in proc.stdout and key not in proc.stderr
    written = [p for p in out.rglob("*") if p.is_file() and not p.is_symlink()]
    assert len(written) > 10
    assert not [p for p in written if key.encode() in p.read_bytes()]
