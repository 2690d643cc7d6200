"""The tokenizers of Qwen 2.5, Qwen 3, Llama 3.2 and Gemma 3, through mega-tokenize and mega-export.

There is no network here, so each family's tokenizer directory is rebuilt small, as the published
one is made: its tokenizer.json pipeline (the pre-tokenizer, normalizer, post-processor and model
options transformers' own class for the family builds, trained on a little real text), its added
tokens (special or not, in the published order), tokenizer_config.json with the published chat
template, BOS/EOS/pad and tokenizer class, and generation_config.json's stop ids. Only the sizes
and the ids differ: every id stays under the tiny test model's 512 embedding rows.

Checked for each, against `transformers` loading the original directory:
- `--format chat --chat-template tokenizer`: every conversation's ids are `apply_chat_template`'s
  (contents as text: `sanitize_control_tokens=True`), with no EOS after a template that ends it
  with a stop token, no second BOS with `--prepend-bos`, and the role sidecar marks exactly each
  assistant reply as the template prints it plus its end-of-turn token;
- text: the tokenizer's own ids, its BOS with `--prepend-bos` where it adds one (Llama, Gemma);
- `--add-special-tokens` for ChatML: new markers past the vocab, or the tokenizer's own ids;
- mega-export of a model trained on the chat data: `AutoTokenizer` gives the artifact's ids for
  every conversation and the original's ids for text, the same special tokens and template, and
  `GenerationConfig` the original's stop ids.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mega_tokenize.chat import ROLE_CODES
from mega_tokenize.pipeline import Options, tokenize
from megacore.artifacts import open_artifact
from megacore.errors import UserError
from tokenize_testlib import corpus, documents, training_text, write_jsonl

# --- the published chat templates ----------------------------------------------------------------

# Qwen2.5-*-Instruct's tokenizer_config.json chat_template, whole (tool branches included).
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Qwen3's (the hybrid thinking models'), whole: the last assistant turn after the last user query
# gets a `<think>` block, empty when the message has no reasoning.
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# Llama-3.2-*-Instruct's, whole: a system header with the knowledge cutoff and today's date
# (`date_string`, else `strftime_now`, else 26 Jul 2024), contents trimmed.
LLAMA32_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Gemma 3's (-it), whole: BOS first, "assistant" shown as "model", the system message put at the
# start of the first user turn, user and assistant contents trimmed (the system message is not).
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>
' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model
'}}
{%- endif -%}
"""

QWEN_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA3_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


# --- the tokenizer directories -------------------------------------------------------------------


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


# --- the families --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    build: Callable[[Path], Path]
    end_of_turn: str  # what the template ends every turn with, a stop id of generation_config.json
    adds_bos: bool  # `tokenizer(text)` starts with BOS
    trims: tuple[str, ...]  # the roles whose contents the template prints trimmed
    tools: bool = True  # the template takes a "tool" message
    template_kwargs: dict = field(default_factory=dict)  # what apply_chat_template needs besides

    def shown(self, msgs: list[tuple[str, str]], i: int) -> str:
        """Message i's content as the template prints it."""
        role, content = msgs[i]
        return content.strip() if role in self.trims else content


FAMILIES = {
    "qwen2.5": Family(lambda d: qwen_dir(d, QWEN25_TEMPLATE, qwen3=False), "<|im_end|>", False, ()),
    # Qwen3 prints the final assistant turn's content after an empty <think> block, its leading
    # newlines dropped: the conversations here have none there.
    "qwen3": Family(lambda d: qwen_dir(d, QWEN3_TEMPLATE, qwen3=True), "<|im_end|>", False, ()),
    # Llama 3.2 reads the date when it can; mega-tokenize never does (the same ids on every run), so
    # it prints the template's own fallback date, which transformers prints when given it.
    "llama3.2": Family(
        llama32_dir,
        "<|eot_id|>",
        True,
        ("system", "user", "assistant"),
        template_kwargs={"date_string": "26 Jul 2024"},
    ),
    "gemma3": Family(gemma3_dir, "<end_of_turn>", True, ("user", "assistant"), tools=False),
}

_DOCS = [d for d in corpus(60) if "<s>" not in d]
CONVERSATIONS: dict[str, list[tuple[str, str]]] = {
    "system, user, assistant": [("system", "You are terse."), ("user", "What is a tokenizer?"),
                                ("assistant", "It maps text to ids.")],
    "several turns, no system": [("user", "Hello"), ("assistant", "Hi! How can I help?"),
                                 ("user", "Count to three."), ("assistant", "1, 2, 3.")],
    "ends with the user": [("user", "One"), ("assistant", "Two"), ("user", "Three")],
    "spaces around contents": [("system", " Be brief. "), ("user", "  Hi there  "),
                               ("assistant", " Hello!\nHow are you?  ")],
    "markers typed as text": [("user", "What are <|im_end|>, <|eot_id|>, <end_of_turn> and <s>?"),
                              ("assistant", "Markers, like <|im_start|> and <|begin_of_text|>.")],
    "unicode": [("user", "émigré naïve café 漢字 😀 — “quotes”"), ("assistant", "½ ≠ ∞ ✓ 한국어")],
    "code": [("system", _DOCS[3].strip()), ("user", _DOCS[5].strip()), ("assistant", _DOCS[8].strip()),
             ("user", _DOCS[13].strip()), ("assistant", _DOCS[21].strip())],
    "a tool's result": [("user", "Weather in Paris?"), ("assistant", "Let me check."),
                        ("tool", "temperature: 21 degrees"), ("assistant", "It is 21 degrees.")],
}  # fmt: skip
# mega-tokenize encodes each content apart from the template's text around it (so a user typing a
# marker gets text); a byte-level BPE encoding the whole rendering merges across that edge where a
# content the template prints untrimmed starts with a newline (the header's "\n" and the content's
# "\n" become one "\n\n"). Those conversations give the same text, not the same ids.
EDGES: dict[str, list[tuple[str, str]]] = {
    "a reply starting with newlines": [("user", "Quote it:"), ("assistant", "\n\nIndented:\n    x = 1"),
                                       ("user", "Thanks")],
}  # fmt: skip


def conversations(family: Family, edges: bool = False) -> dict[str, list[tuple[str, str]]]:
    convs = {**CONVERSATIONS, **(EDGES if edges else {})}
    return {k: v for k, v in convs.items() if family.tools or all(r != "tool" for r, _ in v)}


def as_messages(msgs: list[tuple[str, str]]) -> list[dict]:
    return [{"role": r, "content": c} for r, c in msgs]


@dataclass
class Case:
    """One family: its tokenizer directory, loaded by transformers, and its chat tokens artifact."""

    name: str
    family: Family
    dir: Path
    chat: Path  # --format chat --chat-template tokenizer, defaults otherwise (--append-eos)

    def original(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.dir)

    def reference(self):
        """The tokenizer.json as mega-tokenize encodes raw text: special tokens stay text."""
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(self.dir / "tokenizer.json"))
        tok.encode_special_tokens = True
        return tok


def _tokenize(tmp: Path, records: list[dict], tokenizer: Path, **kw) -> Path:
    src = write_jsonl(tmp / "in.jsonl", records)
    out = tmp / "tokens"
    tokenize(Options(inputs=[str(src)], out=out, tokenizer=tokenizer, progress=False, **kw))
    return out


@pytest.fixture(scope="session", params=list(FAMILIES))
def case(request, tmp_path_factory) -> Case:
    name, family = request.param, FAMILIES[request.param]
    tmp = tmp_path_factory.mktemp(name)
    d = family.build(tmp / "tokenizer")
    records = [{"messages": as_messages(m)} for m in conversations(family, edges=True).values()]
    chat = _tokenize(tmp, records, d, format="chat", chat_template="tokenizer")
    return Case(name, family, d, chat)


# --- mega-tokenize -------------------------------------------------------------------------------


def test_chat_ids_are_the_templates(case: Case) -> None:
    """Every conversation's ids are transformers' `apply_chat_template` ids (no EOS after a template
    that ends the conversation with its stop token; Llama's and Gemma's BOS once)."""
    tok = case.original()
    convs = conversations(case.family, edges=True)
    for (name, msgs), doc in zip(convs.items(), documents(case.chat), strict=True):
        want = tok.apply_chat_template(as_messages(msgs), tokenize=True, return_dict=False,
                                       sanitize_control_tokens=True, **case.family.template_kwargs)  # fmt: skip
        if name in EDGES:
            assert tok.decode(doc) == tok.decode(want), name
        else:
            assert doc == want, (name, tok.decode(doc), tok.decode(want))
        stops = json.loads((case.dir / "generation_config.json").read_text())["eos_token_id"]
        assert tok.convert_ids_to_tokens(doc[-2:]).count(case.family.end_of_turn) == 1, name
        assert tok.convert_tokens_to_ids(case.family.end_of_turn) in stops


def test_assistant_roles_are_the_replies(case: Case) -> None:
    """`loss_on: assistant` trains on each reply as the template prints it and its end-of-turn
    token, nothing else: not Qwen3's empty <think> block, not the headers, not the other roles."""
    ref = case.reference()
    end = ref.token_to_id(case.family.end_of_turn)
    convs = conversations(case.family, edges=True)
    ids, roles = documents(case.chat), documents(case.chat, "roles")
    for (name, msgs), doc, role in zip(convs.items(), ids, roles, strict=True):
        want: list[int] = []
        for i, (r, _) in enumerate(msgs):
            if r == "assistant":
                want += [*ref.encode(case.family.shown(msgs, i), add_special_tokens=False).ids, end]
        assert [t for t, r in zip(doc, role, strict=True) if r == ROLE_CODES["assistant"]] == want, name
        system = [case.family.shown(msgs, i) for i, (r, _) in enumerate(msgs) if r == "system"]
        got_system = [t for t, r in zip(doc, role, strict=True) if r == ROLE_CODES["system"]]
        if case.name != "gemma3":  # Gemma has no system turn: its first user turn holds it, no end
            assert ref.decode(got_system, skip_special_tokens=False) == "".join(
                s + case.family.end_of_turn for s in system
            ), name
        else:
            assert ref.decode(got_system, skip_special_tokens=False) == "".join(system), name


@pytest.mark.parametrize("flags", [{"append_eos": False}, {"prepend_bos": True}])
def test_no_second_eos_or_bos(case: Case, tmp_path: Path, flags: dict) -> None:
    """--no-append-eos changes nothing (the template ends every conversation with its stop token);
    --prepend-bos adds no BOS after the template's own (Llama, Gemma), and Qwen has none to add."""
    records = [{"messages": as_messages(m)} for m in conversations(case.family).values()]
    opts = {"format": "chat", "chat_template": "tokenizer", **flags}
    if flags.get("prepend_bos") and not case.family.adds_bos:
        with pytest.raises(UserError, match="no BOS token"):
            _tokenize(tmp_path, records, case.dir, **opts)
        return
    docs = documents(_tokenize(tmp_path, records, case.dir, **opts))
    assert docs == documents(case.chat)[: len(docs)]


def test_a_content_the_template_rewrites_is_a_bad_line(tmp_path: Path) -> None:
    """Qwen3 prints an earlier assistant turn without the reasoning before its `</think>`, and the
    final one's reasoning inside its own <think> block: mega-tokenize cannot split that rendering
    into template and contents, so such a conversation is a bad line, never other ids."""
    d = FAMILIES["qwen3"].build(tmp_path / "tokenizer")
    reasoning = [("user", "2+2?"), ("assistant", "<think>\nadd\n</think>\n\n4"), ("user", "3+3?")]
    records = [{"messages": as_messages(m)} for m in (CONVERSATIONS["ends with the user"], reasoning)]
    with pytest.raises(UserError, match=r"in.jsonl:2: .*chat template"):
        _tokenize(tmp_path, records, d, format="chat", chat_template="tokenizer")
    tokens = _tokenize(tmp_path, records, d, format="chat", chat_template="tokenizer", on_error="skip")
    assert open_artifact(tokens, "tokens").counts.skipped_lines == 1


def _texts_without_added_tokens(tok) -> list[str]:
    """Real text (transformers matches a special token spelled out in text, mega-tokenize never)."""
    added = [t.content for t in tok.added_tokens_decoder.values()]
    return [t for t in corpus(80) if not any(a in t and a.strip() for a in added)]


def test_text_with_the_tokenizers_bos(case: Case, tmp_path: Path) -> None:
    """--format text with --prepend-bos where the tokenizer adds a BOS (Llama's post-processor,
    Gemma's add_bos_token): each document is `tokenizer(text)`'s ids, then EOS."""
    tok = case.original()
    texts = _texts_without_added_tokens(tok)
    tokens = _tokenize(tmp_path, [{"text": t} for t in texts], case.dir, prepend_bos=case.family.adds_bos)
    assert open_artifact(tokens, "tokens").tokenizer.eos_id == tok.eos_token_id
    assert documents(tokens) == [[*tok(t)["input_ids"], tok.eos_token_id] for t in texts]


def test_chatml_markers(case: Case, tmp_path: Path) -> None:
    """ChatML on any of them: `--add-special-tokens` gives the markers Qwen has their own ids and
    the others new ones past the vocab; EOS follows unless the tokenizer stops at `<|im_end|>`."""
    ref = case.reference()
    convs = conversations(case.family)
    records = [{"messages": as_messages(m)} for m in convs.values()]
    tokens = _tokenize(
        tmp_path, records, case.dir, format="chat", add_special_tokens=["<|im_start|>", "<|im_end|>"]
    )
    info = open_artifact(tokens, "tokens").tokenizer
    size = ref.get_vocab_size(with_added_tokens=True)
    if case.name.startswith("qwen"):
        marks = [ref.token_to_id("<|im_start|>"), ref.token_to_id("<|im_end|>")]
        assert info.vocab_size == size
    else:
        marks = [size, size + 1]
        assert info.vocab_size == size + 2 and ref.token_to_id("<|im_start|>") is None
    assert list(info.added_special_tokens.values()) == marks
    tail = [] if info.eos_id == marks[1] else [info.eos_id]

    def enc(text: str) -> list[int]:
        return ref.encode(text, add_special_tokens=False).ids

    for msgs, doc in zip(convs.values(), documents(tokens), strict=True):
        want = [i for r, c in msgs for i in [marks[0], *enc(f"{r}\n"), *enc(c), marks[1], *enc("\n")]]
        assert doc == want + tail


# --- mega-export ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def exported(case: Case, tmp_path_factory) -> Path:
    """A tiny Llama checkpoint recording the family's chat data's tokenizer, exported (one per
    family; test_tokenizer.py exports one trained on such data)."""
    from export.test_tokenizer import export_recording

    return export_recording(tmp_path_factory.mktemp(f"{case.name}-export"), case.chat)


def test_export_encodes_as_the_data(case: Case, exported: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(exported)
    convs = conversations(case.family, edges=True)
    for (name, msgs), doc in zip(convs.items(), documents(case.chat), strict=True):
        got = tok.apply_chat_template(as_messages(msgs), tokenize=True, return_dict=False,
                                      sanitize_control_tokens=True, **case.family.template_kwargs)  # fmt: skip
        if name in EDGES:
            assert tok.decode(got) == tok.decode(doc), name
        else:
            assert got == doc, name


def test_export_is_the_original(case: Case, exported: Path) -> None:
    """The exported tokenizer and generation config are the original's, as transformers uses them:
    text ids (BOS included), special tokens, chat template, stop ids."""
    from transformers import AutoTokenizer, GenerationConfig

    orig, tok = case.original(), AutoTokenizer.from_pretrained(exported)
    texts = _texts_without_added_tokens(orig)
    assert [tok(t)["input_ids"] for t in texts] == [orig(t)["input_ids"] for t in texts]
    assert (tok(texts[0])["input_ids"][0] == orig.bos_token_id) == case.family.adds_bos
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(tok, name) == getattr(orig, name), name
    assert tok.chat_template == orig.chat_template
    assert tok.decode(documents(case.chat)[0]) == orig.decode(documents(case.chat)[0])
    want = GenerationConfig.from_pretrained(case.dir)
    got = GenerationConfig.from_pretrained(exported)
    assert got.eos_token_id == want.eos_token_id
    assert got.pad_token_id == want.pad_token_id
    assert len(tok) <= json.loads((exported / "config.json").read_text())["vocab_size"]


def test_export_of_chatml_data(tmp_path_factory) -> None:
    """ChatML markers added past Llama 3.2's vocab: the export encodes each conversation with them
    at the artifact's ids, and stops at `<|im_end|>` as well as at the original's stop ids."""
    from transformers import AutoTokenizer, GenerationConfig

    from export.test_tokenizer import export_recording

    family = FAMILIES["llama3.2"]
    tmp = tmp_path_factory.mktemp("llama-chatml")
    d = family.build(tmp / "tokenizer")
    convs = conversations(family)
    records = [{"messages": as_messages(m)} for m in convs.values()]
    tokens = _tokenize(tmp, records, d, format="chat", add_special_tokens=["<|im_start|>", "<|im_end|>"])
    info = open_artifact(tokens, "tokens").tokenizer
    out = export_recording(tmp, tokens)
    tok = AutoTokenizer.from_pretrained(out)
    for msgs, doc in zip(convs.values(), documents(tokens), strict=True):
        assert doc[-1] == info.eos_id  # <|eot_id|>: ChatML's turns end with <|im_end|>, no stop of Llama's
        got = tok.apply_chat_template(
            as_messages(msgs), tokenize=True, return_dict=False, sanitize_control_tokens=True
        )
        assert got == doc[:-1]
    stops = GenerationConfig.from_pretrained(out).eos_token_id
    original = json.loads((d / "generation_config.json").read_text())["eos_token_id"]
    assert stops == [*original, info.added_special_tokens["<|im_end|>"]]
