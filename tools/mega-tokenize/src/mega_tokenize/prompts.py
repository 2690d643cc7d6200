"""Prompts for online RL (`--format prompts`): one document per row, the prompt's tokens, and the
row's other columns kept beside them, typed, for the reward functions.

A row is `{"prompt": ..., **columns}` (jsonl, Parquet, a dataset). A string prompt is encoded as it
is (BOS before it with `--prepend-bos`; its tokens the user's role code); an array of `{"role",
"content"}` messages is rendered by `--chat-template` with the generation prompt
(`add_generation_prompt`, as TRL's GRPOTrainer renders prompts), so what the model writes next is
the assistant's turn. No EOS: the model writes on from the prompt's last token.

The row itself, the prompt as given and every other key (`answer`, `solution`, tests...), is kept
in `shards/prompts.columns.parquet` (the reward functions get the prompt as TRL hands it to them, a
string or the messages), one row per document in the shard's order (rows skipped by `--on-error skip` are in neither), a key
a row lacks null in it; each column's type is what pyarrow infers over all rows, recorded in the
manifest's `columns`. The rows are held until the end to infer their types: prompt sets are small
(tens of thousands of rows) next to pretraining corpora.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mega_tokenize.chat import ROLE_CODES, ChatError, Segment, json_type, message_list
from megacore.errors import UserError

PROMPT = "prompt"
COLUMNS_SUFFIX = ".columns.parquet"  # beside the shard's prefix


class PromptRenderer:
    """A row to its prompt's segments (`__call__`) and its other columns (`columns`).

    `render` is the chat renderer with its generation prompt wrapped by `with_ends` (BOS only), or the
    UserError building it raised: string prompts need none, so it is raised at the first
    conversation, for the whole run."""

    def __init__(self, bos: int | None, render: Callable[[list], list[Segment]] | UserError) -> None:
        self.bos, self.render = bos, render

    def __call__(self, row: object) -> list[list[Segment]]:
        if not isinstance(row, dict):
            raise ChatError(f"expected a JSON object with a prompt, got {json_type(row)}")
        if PROMPT not in row:
            raise ChatError('missing key "prompt"')
        prompt = row[PROMPT]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ChatError('"prompt" is empty')
            bos = [Segment(None, self.bos, 0)] if self.bos is not None else []
            return [[*bos, Segment(prompt, None, ROLE_CODES["user"])]]
        if not isinstance(prompt, list):
            raise ChatError(f'"prompt" is {json_type(prompt)}, expected a string or an array of messages')
        messages = message_list(prompt, PROMPT)
        if not any(c.strip() for _, c in messages):
            raise ChatError('"prompt": every message content is empty')
        if isinstance(self.render, UserError):
            raise self.render
        return [self.render(messages)]

    @staticmethod
    def columns(row: dict) -> dict:
        """The row's columns, kept for the reward functions: the prompt as given, and the others."""
        return row


def write_columns(rows: list[dict], path: Path) -> dict[str, str]:
    """`rows` as one Parquet file (nothing written when no row has a column); the columns' types, as
    the manifest records them. A column whose rows hold values of no one type is a UserError naming
    it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = list(dict.fromkeys(k for r in rows for k in r))
    if not names:
        return {}
    arrays = {}
    for name in names:
        values = [r.get(name) for r in rows]
        try:
            arrays[name] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            kinds = sorted({json_type(v) for v in values if v is not None})
            raise UserError(
                f'column "{name}" holds {", ".join(kinds)} in different rows ({e}); give it one type in every row',
                "--format prompts",
            ) from None
    pq.write_table(pa.table(arrays), path)
    return {f.name: str(f.type) for f in pq.read_schema(path)}  # as a reader sees them
