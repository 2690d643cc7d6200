"""Chat fine-tuning throughput: packed conversations against one conversation per sample.

The same chat tokens artifact (conversations cut from the Python standard library's sources: a user
turn and an assistant turn of random lengths, about 250 tokens each, tokenized by `mega-tokenize
--format chat` with ChatML markers and the CPU training benchmarks' tokenizer: benchlib's
`train_data`) trained by `mega-train` with `data.loss_on: assistant`, once with `data.packing:
pack` and once with `pad`: one process, 2 threads, bf16, a small Llama
(hidden 256, 4 layers, seq 1024; `--quick`: hidden 64, 2 layers, seq 256), micro batch 4 x 2
accumulation. The figure is counted tokens per second: the assistant tokens trained on
(`counted_tokens` in metrics.jsonl) over the summed `step_time_s` of the steps after 2 warm-up ones.
Padding spends the same compute per sample on fewer counted tokens, so packing should win by about
the ratio of a sample's slots to one conversation's length. Rounds interleaved (benchlib's
`paired_rounds`: pack, pad, then pad, pack), 2 rounds (`--quick`: 1); the ratio is the median over
rounds of pack / pad.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from benchlib import (
    OUT,
    THREADS,
    ChildFailed,
    failure,
    logger,
    median_ratio,
    paired_rounds,
    rounds_note,
    run_mega_train,
    tokenize,
    train_data,
)
from run import Row

WORK = OUT / "instruct"
CHATML = "<|im_start|>,<|im_end|>"


def chat_corpus(path: Path, n: int = 3000) -> Path:
    """Conversations from the standard library's text: a user turn of 50-400 characters and an
    assistant turn of 100-1200 (about 250 tokens a conversation, as instruction sets have), cut at
    random places (seeded)."""
    if path.exists():
        return path
    texts = [json.loads(line)["text"] for line in train_data().corpus.read_text().splitlines()]
    rng = random.Random(0)
    lines = []
    for _ in range(n):
        t = rng.choice(texts)
        a, b = rng.randrange(50, 400), rng.randrange(100, 1200)
        start = rng.randrange(max(1, len(t) - a - b))
        user, reply = t[start : start + a], t[start + a : start + a + b]
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        lines.append(json.dumps({"messages": messages}) + "\n")
    path.write_text("".join(lines))
    return path


def manifest(tokens: Path, vocab: int, packing: str, quick: bool, steps: int) -> dict:
    hidden, layers, seq = (64, 2, 256) if quick else (256, 4, 1024)
    config = dict(
        family="llama", vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2,
        ffn_hidden_size=hidden * 8 // 3 // 8 * 8, max_seq_len=seq,
    )  # fmt: skip
    return {
        "kind": "run", "format_version": 1, "model": {"config": config},
        "data": {"sources": [{"path": str(tokens)}], "split": [1, 0], "loss_on": "assistant", "packing": packing},
        "batch": {"micro_batch_size": 4, "global_batch_size": 8, "seq_length": seq},
        "train_steps": steps, "precision": "bf16", "optimizer": {"lr": 3e-4, "warmup_steps": 0},
        "logging": {"every": 1}, "checkpoint": {"every": 100000},
    }  # fmt: skip


def measure(tokens: Path, vocab: int, packing: str, quick: bool, work: Path, warmup: int, timed: int) -> dict:
    try:
        records, rss = run_mega_train(manifest(tokens, vocab, packing, quick, warmup + timed), work)
    except ChildFailed as e:
        return {"error": str(e)}
    steps = [r for r in records if r["kind"] == "train"][warmup:]
    counted = sum(r["counted_tokens"] for r in steps)
    return {
        "counted_per_s": counted / sum(r["step_time_s"] for r in steps),
        "counted_share": counted / sum(r["tokens_per_s"] * r["step_time_s"] for r in steps),
        "rss": rss,
    }


def run(quick: bool) -> list[Row]:
    WORK.mkdir(parents=True, exist_ok=True)
    src = chat_corpus(WORK / "chat.jsonl", 400 if quick else 3000)
    tokens = WORK / "chat-tokens"
    chat = ["--format", "chat", "--add-special-tokens", CHATML, "--workers", str(THREADS)]
    tokenize(src, tokens, train_data().tokenizer, *chat)
    tok = json.loads((tokens / "manifest.json").read_text())["tokenizer"]
    vocab = tok["vocab_size"]
    rounds, warmup, timed = (1, 1, 2) if quick else (2, 2, 6)

    def one(packing: str, r: int) -> dict:
        return measure(tokens, vocab, packing, quick, WORK / f"{packing}-{r}", warmup, timed)

    results = paired_rounds(("pack", "pad"), rounds, one, log=logger("instruct"))
    metric = "counted tokens/s, packed vs padded chat (loss on assistant)"
    if failed := failure(results):
        return [Row("instruct", metric, "-", "-", None, note=": ".join(failed), passed=False)]
    pack, pad = ([x["counted_per_s"] for x in results[k]] for k in ("pack", "pad"))
    ratio = median_ratio(pack, pad)
    share = {k: results[k][0]["counted_share"] for k in results}
    note = (
        f"{'quick' if quick else 'hidden 256, 4 layers, seq 1024'}, 4x2 sequences/step, bf16, {THREADS} threads, "
        f"{timed} timed steps; counted share of the slots: pack {share['pack']:.2f}, pad {share['pad']:.2f}; "
        f"{rounds_note(pack, pad)}"
    )
    return [Row("instruct", metric, f"{max(pack):.0f}", f"{max(pad):.0f}", ratio, "> 1x", note)]
