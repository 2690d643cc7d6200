"""The tokenizer directories of Qwen 2.5, Qwen 3, Llama 3.2 and Gemma 3, rebuilt small, as the
published ones are made (there is no network here): the tokenizer.json pipeline (the
pre-tokenizer, normalizer, post-processor and model options transformers' own class for the
family builds, trained on a little real text), the added tokens (special or not, in the published
order), tokenizer_config.json with the published chat template (tests/family_templates.py),
BOS/EOS/pad and tokenizer class, and generation_config.json's stop ids. Only the sizes and the ids
differ: every id stays under the tiny test model's 512 embedding rows.
"""

from __future__ import annotations

import json
from pathlib import Path

from family_templates import GEMMA3_TEMPLATE, LLAMA32_TEMPLATE
from tokenize_testlib import corpus, training_text

# The pre-tokenizers' regex splits, as the published tokenizer.json files hold them.
QWEN_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA3_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def _texts() -> list[str]:
    """What the small tokenizers learn from: real multi-line documents, some as paragraphs (so
    newline and indentation runs become tokens, as in the real vocabularies)."""
    docs = corpus(300)
    paragraphs = ["\n\n".join(docs[i : i + 3]) for i in range(0, 300, 3)]
    return docs + paragraphs * 4 + ["Sure!\n\nHere it is:\n\n\n"] * 200 + training_text()


def _byte_level_bpe(regex: str, vocab_size: int, nfc: bool, trim_offsets: bool) -> dict:
    """A byte-level BPE tokenizer.json (as a dict) with the GPT-4-style regex split Qwen and Llama 3
    use, trained here: no added tokens yet."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=trim_offsets, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_texts(), trainer)
    return json.loads(tok.to_str())


def _added(data: dict, tokens: list[tuple[str, bool]]) -> dict[str, int]:
    """Append added tokens (content, special) after the vocab, in order; their ids."""
    top = max([*data["model"]["vocab"].values(), *(t["id"] for t in data["added_tokens"])]) + 1
    ids = {}
    for i, (content, special) in enumerate(tokens, start=top):
        data["added_tokens"].append(
            {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": special}
        )  # fmt: skip
        ids[content] = i
    return ids


def _config_tokens(data: dict) -> dict:
    """tokenizer_config.json's `added_tokens_decoder`, as save_pretrained writes it."""
    return {
        str(t["id"]): {
            k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
        }
        for t in data["added_tokens"]
    }


def _write(d: Path, data: dict, config: dict, generation: dict) -> Path:
    """The directory `d` with its tokenizer.json, tokenizer_config.json and generation_config.json."""
    d.mkdir(parents=True)
    (d / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (d / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return d


QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>"]
QWEN_TEXT_TOKENS = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"]


def qwen_dir(d: Path, template: str, qwen3: bool) -> Path:
    """Qwen2.5-Instruct's layout (Qwen3: its template and the four added tokens it has more)."""
    data = _byte_level_bpe(QWEN_REGEX, 440, nfc=True, trim_offsets=False)
    data["model"].update(continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                         byte_fallback=False, ignore_merges=False)  # fmt: skip
    data["post_processor"] = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    text = QWEN_TEXT_TOKENS + (
        ["<tool_response>", "</tool_response>", "<think>", "</think>"] if qwen3 else []
    )
    ids = _added(data, [(t, True) for t in QWEN_SPECIAL] + [(t, False) for t in text])
    config = {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": _config_tokens(data),
        "additional_special_tokens": QWEN_SPECIAL[1:], "bos_token": None, "chat_template": template,
        "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
        "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }  # fmt: skip
    end, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    generation = {"bos_token_id": end, "do_sample": True, "eos_token_id": [im_end, end], "pad_token_id": end,
                  "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8}  # fmt: skip
    return _write(d, data, config, generation)


LLAMA_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                 "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                 "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]  # fmt: skip


def llama32_dir(d: Path) -> Path:
    """Llama-3.2-Instruct's layout: BOS added by the tokenizer.json's TemplateProcessing."""
    data = _byte_level_bpe(LLAMA3_REGEX, 450, nfc=False, trim_offsets=True)
    data["model"]["ignore_merges"] = True
    ids = _added(data, [(t, True) for t in LLAMA_SPECIAL])
    bos = "<|begin_of_text|>"
    data["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {bos: {"id": bos, "ids": [ids[bos]], "tokens": [bos]}}},
    ]}  # fmt: skip
    config = {
        "added_tokens_decoder": _config_tokens(data), "bos_token": bos, "chat_template": LLAMA32_TEMPLATE,
        "clean_up_tokenization_spaces": True, "eos_token": "<|eot_id|>",
        "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }  # fmt: skip
    stops = [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]
    generation = {
        "bos_token_id": ids[bos],
        "do_sample": True,
        "eos_token_id": stops,
        "temperature": 0.6,
        "top_p": 0.9,
    }
    return _write(d, data, config, generation)


GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_NEWLINES = ["\n", "\n\n", "\n\n\n"]  # user-defined pieces of the .model: added tokens, not special


def gemma3_dir(d: Path) -> Path:
    """Gemma 3's layout: sentencepiece's BPE as transformers' GemmaConverter writes it (spaces as
    U+2581 by a normalizer, no dummy prefix, byte fallback, newline runs as added tokens), BOS by
    `add_bos_token` and the TemplateProcessing it makes."""
    from tokenizers import Tokenizer, models, normalizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    trainer = trainers.BpeTrainer(vocab_size=220, show_progress=False)
    tok.train_from_iterator([t for doc in _texts() for t in doc.split("\n") if t], trainer)
    trained = json.loads(tok.to_str())["model"]
    vocab = {t: i for i, t in enumerate(GEMMA_SPECIAL)}
    vocab.update({f"<0x{b:02X}>": len(GEMMA_SPECIAL) + b for b in range(256)})
    for t in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(t, len(vocab))
    for t in GEMMA_NEWLINES:
        vocab[t] = len(vocab)
    data = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False},
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": trained["merges"]},
    }  # fmt: skip
    for t in GEMMA_SPECIAL + GEMMA_NEWLINES:
        data["added_tokens"].append(
            {"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": t in GEMMA_SPECIAL}
        )  # fmt: skip
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "<bos>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<bos>": {"id": "<bos>", "ids": [2], "tokens": ["<bos>"]}},
    }  # fmt: skip
    config = {
        "add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": _config_tokens(data),
        "bos_token": "<bos>", "chat_template": GEMMA3_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": "<eos>", "model_max_length": 1000000000000000019884624838656, "pad_token": "<pad>",
        "spaces_between_special_tokens": False, "tokenizer_class": "GemmaTokenizer", "unk_token": "<unk>",
        "use_default_system_prompt": False,
    }  # fmt: skip
    generation = {"bos_token_id": 2, "cache_implementation": "hybrid", "do_sample": True,
                  "eos_token_id": [1, vocab["<end_of_turn>"]], "pad_token_id": 0, "top_k": 64, "top_p": 0.95}  # fmt: skip
    return _write(d, data, config, generation)
