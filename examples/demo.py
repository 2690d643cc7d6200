"""`make demo`: the chain end to end on a built-in example, each step a real CLI call.

    corpus (Python's own documentation, about 0.2 MB) --mega-tokenize--> tokens
    conversations about the same documentation --mega-tokenize --format chat--> chat tokens
        (what examples/instruct.json tunes on), and pairs of a right and a wrong answer
        --mega-tokenize --format preference--> pair tokens (examples/dpo.json's)
    tiny random Llama, or `--family qwen3` a tiny Qwen 3 (tied embeddings, q/k norms), from
        transformers --mega-convert hf--> checkpoint --mega-convert verify
    checkpoint --mega-shard --tp 2 --pp 2--> checkpoint --mega-export--> HF dir --mega-convert verify
    run.json --mega-train --dry-run--> the resolved 3D plan
    run.json --torchrun mega-train (tp 2 x pp 2)--> trained checkpoint
    trained checkpoint --mega-export (with its tokenizer and model card)--> HF dir
        --transformers--> a completed line of text;  --push-to-hub --dry-run--> the upload's files

Every command is printed before it runs, so this doubles as a copy-paste tutorial. Rerunning reuses
what is already complete (the tools are idempotent). A summary closes it: the artifacts, the
losses, the logits parity and the completion. Its console is the tools' quiet one (its own model
building too: `megacore.cli.quiet_libraries`); `--debug` (or `MEGA_DEBUG=1 make demo`) shows what
the libraries print, in it and in every tool it runs.
"""

from __future__ import annotations

import io
import json
import os
import pydoc
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import zstandard

BIN = Path(sys.executable).parent
SHARED_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "assets" / "mistral-v1-tokenizer.model"
MODULES = ["json", "pathlib", "collections", "itertools", "functools", "re", "os", "typing", "dataclasses"]
# Mistral Instruct's [INST] format: its markers are plain text to the tokenizer, so the chat data
# needs no added tokens and fits the model's vocab as it is (ChatML's two markers would not).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)


def sh(*args: object) -> str:
    """Run a command (shown first), its output shown as it goes; returns its stdout."""
    cmd = [str(a) for a in args]
    print("$ " + shlex.join([Path(cmd[0]).name, *cmd[1:]]), flush=True)
    proc = subprocess.run(
        [str(BIN / cmd[0]) if (BIN / cmd[0]).exists() else cmd[0], *cmd[1:]],
        check=True, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    print(proc.stdout, end="", flush=True)
    return proc.stdout


def complete(model_dir: Path, prompt: str, tokens: int = 16) -> str:
    """Greedy continuation of `prompt` by the exported model, loaded by transformers alone."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tok(prompt, return_tensors="pt")
    # 30 steps of a tiny model: it has learnt the corpus's commonest tokens; the penalties keep
    # greedy decoding from repeating the commonest one (a newline) 16 times.
    out = model.generate(
        **ids, max_new_tokens=tokens, do_sample=False, pad_token_id=tok.eos_token_id,
        repetition_penalty=1.3, no_repeat_ngram_size=2,
    )  # fmt: skip
    return tok.decode(out[0][ids["input_ids"].shape[1] :], skip_special_tokens=True)


def documented() -> list[tuple[str, str]]:
    """(name, documentation) of every well-documented object of a few standard-library modules."""
    docs = []
    for name in MODULES:
        module = __import__(name)
        for attr in sorted(dir(module)):
            text = pydoc.getdoc(getattr(module, attr, None) or "")
            if len(text) > 80:
                docs.append((f"{name}.{attr}", text))
    return docs


def corpus(out: Path) -> Path:
    """One jsonl.zst document per documented object."""
    path = out / "corpus.jsonl.zst"
    if path.exists():
        return path
    docs = [{"text": f"{name}\n{text}"} for name, text in documented()]
    raw = "".join(json.dumps(d) + "\n" for d in docs).encode()
    path.write_bytes(zstandard.ZstdCompressor().compress(raw))
    print(f"corpus: {len(docs)} documents, {len(raw) / 1e6:.1f} MB -> {path}")
    return path


def tokenizer(out: Path, corpus_path: Path) -> Path:
    """The real Mistral tokenizer when ../shared has it, else a 1k SentencePiece trained here."""
    if SHARED_TOKENIZER.is_file():
        return SHARED_TOKENIZER
    model = out / "tokenizer.model"
    if not model.exists():
        import sentencepiece as spm

        lines = [json.loads(x)["text"] for x in zstandard.decompress(corpus_path.read_bytes()).splitlines()]
        buf = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=buf,
            vocab_size=1000,
            model_type="bpe",
            byte_fallback=True,
            bos_id=1,
            eos_id=2,
            unk_id=0,
            minloglevel=2,
        )
        model.write_bytes(buf.getvalue())
    return model


def chat_tokens(out: Path, tok: Path) -> Path:
    """A chat tokens artifact (examples/instruct.json's data): per documented object, the user asks
    what it is and the assistant answers with its documentation's first paragraph, rendered with
    CHAT_TEMPLATE from a tokenizer directory (the tokenizer, and a tokenizer_config.json with it)."""
    chats, tok_dir = out / "chat.jsonl", out / "chat-tokenizer"
    if not chats.exists():
        lines = [
            {"messages": [{"role": "user", "content": f"What is {name}?"},
                          {"role": "assistant", "content": text.split("\n\n")[0]}]}
            for name, text in documented()
        ]  # fmt: skip
        chats.write_text("".join(json.dumps(c) + "\n" for c in lines))
    if not (tok_dir / "tokenizer_config.json").exists():
        tok_dir.mkdir(exist_ok=True)
        shutil.copy(tok, tok_dir / "tokenizer.model")
        (tok_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    # --no-append-eos: the template ends each answer with EOS already.
    sh("mega-tokenize", chats, out / "chat-tokens", "--tokenizer", tok_dir, "--format", "chat",
       "--chat-template", "tokenizer", "--no-append-eos")  # fmt: skip
    return out / "chat-tokens"


def pair_tokens(out: Path, tok: Path) -> Path:
    """A preference tokens artifact (examples/dpo.json's data): per documented object, the user asks
    what it is; the chosen answer is its documentation's first paragraph, the rejected one the next
    object's (a wrong answer), as TRL's conversational rows, rendered as `chat_tokens` renders."""
    rows, tok_dir = out / "pairs.jsonl", out / "chat-tokenizer"
    chat_tokens(out, tok)  # the tokenizer directory with the chat template
    if not rows.exists():
        docs = documented()
        lines = [
            {"prompt": [{"role": "user", "content": f"What is {name}?"}],
             "chosen": [{"role": "assistant", "content": text.split("\n\n")[0]}],
             "rejected": [{"role": "assistant", "content": docs[(i + 1) % len(docs)][1].split("\n\n")[0]}]}
            for i, (name, text) in enumerate(docs)
        ]  # fmt: skip
        rows.write_text("".join(json.dumps(r) + "\n" for r in lines))
    # --on-error skip: two objects documented alike (aliases) make a pair of identical sides.
    sh("mega-tokenize", rows, out / "pair-tokens", "--tokenizer", tok_dir, "--format", "preference",
       "--chat-template", "tokenizer", "--no-append-eos", "--on-error", "skip")  # fmt: skip
    return out / "pair-tokens"


# The demo's model by family: a transformers config class and its sizes beyond the shared ones.
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    # Qwen 3 as its small sizes are: tied embeddings (under pp the last stage holds a copy), q/k norms.
    "qwen3": ("Qwen3Config", {"head_dim": 16, "tie_word_embeddings": True}),
}


def tiny_model(out: Path, vocab_size: int, family: str = "llama") -> Path:
    """A randomly initialised 4-layer model with GQA of `family`, saved the way the hub ships
    models (with a model card whose license the chain carries to the export's card)."""
    path = out / f"hf-{family}"
    if (path / "config.json").exists():
        return path
    import torch
    import transformers

    transformers.logging.disable_progress_bar()  # the demo prints the tools' output, not theirs
    torch.manual_seed(0)
    cls, extra = FAMILIES[family]
    cfg = getattr(transformers, cls)(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        **extra,
    )
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    (path / "README.md").write_text(f"---\nlicense: apache-2.0\n---\n# A tiny random {family} for the demo\n")
    return path


def main(out: Path, family: str = "llama") -> None:
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    text = corpus(out)
    tok = tokenizer(out, text)
    sh("mega-tokenize", text, out / "tokens", "--tokenizer", tok, "--workers", "2")
    chat = chat_tokens(out, tok)
    pairs = pair_tokens(out, tok)

    import sentencepiece as spm

    vocab = spm.SentencePieceProcessor(model_file=str(tok)).vocab_size()
    hf = tiny_model(out, vocab, family)
    sh("mega-convert", "hf", hf, out / "ckpt-tp1pp1")
    sh("mega-convert", "verify", out / "ckpt-tp1pp1", hf)
    sh("mega-shard", out / "ckpt-tp1pp1", out / "ckpt-tp2pp2", "--tp", "2", "--pp", "2")
    sh("mega-export", out / "ckpt-tp2pp2", out / "hf-export", "--force")
    parity = sh("mega-convert", "verify", out / "ckpt-tp2pp2", out / "hf-export")  # the sharded one

    # Fine-tune the sharded checkpoint on the tokens: 4 processes as tp 2 x pp 2, then export the
    # trained model. Rerunning resumes from the newest checkpoint (here: finds the run complete).
    run = {
        "kind": "run",
        "format_version": 5,
        "out": "train-run",
        "model": {"init": "ckpt-tp2pp2"},
        "data": {"sources": [{"path": "tokens"}], "split": [0.95, 0.05]},
        "batch": {"micro_batch_size": 2, "global_batch_size": 8, "seq_length": 128},
        "train_steps": 30,
        "parallel": {"tp": 2, "pp": 2, "schedule": "1f1b"},
        "precision": "fp32",  # bf16 (the default) pays on GPUs; on this CPU demo fp32 is faster
        "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 3},
        "checkpoint": {"every": 10, "keep": 2},
        "eval": {"every": 10, "iters": 2},
        "logging": {"every": 5},
    }
    (out / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    sh("mega-train", "--manifest", out / "run.json", "--dry-run", "--world-size", "8")
    # --json: the console lines go to stderr, and stdout is the summary that names the final
    # checkpoint (`out`), as an orchestrator reads it.
    done = sh(
        "torchrun", "--nproc-per-node", "4", BIN / "mega-train", "--manifest", out / "run.json", "--json"
    )
    trained = Path(json.loads(done)["out"])
    # The export carries the tokenizer the data was tokenized with and a model card; --dry-run
    # lists what a push would upload (drop it, with HF_TOKEN set, to publish).
    sh(
        "mega-export",
        trained,
        out / "hf-trained",
        "--force",
        "--push-to-hub",
        f"me/tiny-{family}-demo",
        "--dry-run",
    )
    sh("mega-convert", "verify", trained, out / "hf-trained")
    prompt = "Return a new list"
    print(f"$ python -c 'transformers: complete {prompt!r}'", flush=True)
    completion = complete(out / "hf-trained", prompt)
    print(repr(prompt + completion))

    records = [json.loads(x) for x in (out / "train-run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    print(f"\ndemo: done; artifacts in {out}/")
    print(f"  tokens       {out / 'tokens'}, {chat} (conversations, for examples/instruct.json), {pairs}")
    print("               (preference pairs, for examples/dpo.json after examples/instruct.json)")
    print(f"  checkpoints  {out / 'ckpt-tp1pp1'} (converted), {out / 'ckpt-tp2pp2'} (tp 2 x pp 2), {trained}")
    print(f"  HF exports   {out / 'hf-export'}, {out / 'hf-trained'} (with tokenizer and README.md)")
    print(
        f"  train loss   {train[0]['loss']:.4f} at step {train[0]['step']} -> {train[-1]['loss']:.4f} at step {train[-1]['step']}"
    )
    if evals:
        print(f"  valid loss   {evals[0]['loss']:.4f} -> {evals[-1]['loss']:.4f}")
    print(f"  parity       {parity.strip()}")
    print(f"  completion   {prompt!r} -> {completion!r}")
    card = (out / "hf-trained" / "README.md").read_text().splitlines()
    lic = next((x.removeprefix("license:").strip() for x in card if x.startswith("license:")), "none")
    print(f"  license      {lic}, from the source model's card to the export's")


if __name__ == "__main__":
    from megacore.cli import quiet_libraries, split_debug

    args, debug = split_debug(sys.argv[1:])
    if debug:
        os.environ["MEGA_DEBUG"] = "1"  # the tools it runs show everything too
    else:
        quiet_libraries()  # before transformers imports torchao, which logs then
    family = args.pop(args.index("--family") + 1) if "--family" in args else "llama"
    args = [a for a in args if a != "--family"]
    main(Path(args[0] if args else "demo-out"), family)
