"""The reward functions of online RL (`mega_train.rewards`; #51's first piece: the `grpo` objective
that calls them is not built yet), against TRL's own reward functions where TRL has one of the
same meaning (`trl.rewards`), against cases worked out here where it has not, and each refusal as
one line naming where."""

from __future__ import annotations

from pathlib import Path

import pytest
from trl.rewards import accuracy_reward, get_soft_overlong_punishment, think_format_reward

from mega_train.rewards import RewardError, load_rewards, score
from mega_train.rewards.builtin import exact_answer, final_answer, format_match, length_penalty, math_answer
from megacore.errors import UserError

WHERE = "$.objective.rewards"


def _messages(texts: list[str]) -> list[list[dict[str, str]]]:
    return [[{"role": "assistant", "content": t}] for t in texts]


def test_math_agrees_with_trls_accuracy_reward_on_boxed_answers() -> None:
    """Boxed answers, as TRL's accuracy_reward reads them (the same math-verify underneath, our own
    extraction): equal forms of one number match, others do not; a gold answer math-verify cannot
    parse is None in both."""
    cases = [
        (r"So the answer is \boxed{\frac{1}{2}}.", "0.5"),
        (r"It is \boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{x^2 + 2x}", "$x(x+2)$"),
        (r"\boxed{x^2 + 2x}", "x(x+2)"),
        (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}"),
        (r"the answer is \boxed{7}", "8"),
        (r"\boxed{12}", "twelve apples"),
    ]
    texts, golds = [c for c, _ in cases], [g for _, g in cases]
    ours = math_answer(completions=_messages(texts), answer=golds)
    theirs = accuracy_reward(completions=_messages(texts), solution=golds)
    assert ours == theirs == [1.0, 1.0, 1.0, None, 0.0, 0.0, None]


def test_math_reads_the_last_box_as_the_final_answer() -> None:
    """TRL's accuracy_reward takes the first box; a completion that corrects itself is scored by
    its last one here."""
    text = [r"First \boxed{3}, no wait: \boxed{4}"]
    assert math_answer(completions=text, answer=["4"]) == [1.0]
    assert accuracy_reward(completions=_messages(text), solution=["4"]) == [0.0]


def test_math_reads_the_last_number_when_nothing_is_boxed() -> None:
    assert final_answer("3 + 4 = 7, so 7 apples") == "7"
    assert final_answer("in total 1,234.5 units") == "1234.5"
    assert final_answer("a third: 1/3") == "1/3"
    assert final_answer("no number here") is None
    texts = ["3 + 4 = 7", "I think it is 12.", "the result: 1/4", "no idea", "-5 degrees"]
    assert math_answer(completions=texts, answer=["7", "13", "0.25", "1", "-5"]) == [1.0, 0.0, 1.0, 0.0, 1.0]


def test_exact_format_and_length_against_trl() -> None:
    assert exact_answer(completions=[" 42\n", "42.0", "forty-two"], answer=[42, "42", "forty-two "]) == [
        1.0,
        0.0,
        1.0,
    ]
    # TRL's think-format reward is a regular expression: ours given the same one agrees with it.
    pattern = r"^<think>(?!.*<think>)(.*?)</think>.*$"
    texts = [
        "<think>a\nb</think>\nanswer",
        "answer <think>x</think>",
        "<think>x</think><think>y</think>",
        "<think>x",
    ]
    assert format_match(completions=texts, pattern=pattern) == think_format_reward(_messages(texts)) == [
        1.0, 0.0, 0.0, 0.0,
    ]  # fmt: skip
    ids = [[0] * n for n in range(0, 14)]
    theirs = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)(completion_ids=ids)
    assert length_penalty(completion_ids=ids, max_length=10, cache=4) == pytest.approx(theirs)
    assert length_penalty(completion_ids=ids[5:9], max_length=10, cache=4) == [0.0, 0.0, -0.25, -0.5]


def test_rewards_load_from_a_file_beside_the_manifest_and_from_a_module(tmp_path: Path) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "def brevity(prompts, completions, completion_ids, scale=1.0, **columns):\n"
        "    return [scale / (1 + len(ids)) for ids in completion_ids]\n"
    )
    specs = [
        {"function": "my_rewards.py:brevity", "weight": 2.0, "args": {"scale": 3.0}},
        {"function": "trl.rewards:think_format_reward", "weight": 0.5},
        {"function": "exact"},
    ]
    rewards = load_rewards(specs, tmp_path, WHERE)
    assert [r.name for r in rewards] == [s["function"] for s in specs]
    completions = _messages(["<think>x</think>4", "4"])
    got = score(rewards, ["2+2=", "2+2="], completions, [[1, 2], [3]], {"answer": ["4", "4"]})
    # brevity 3/3 and 3/2 weighted 2; the think format 1 and 0 weighted 0.5; exact 0 and 1
    assert got.total == pytest.approx([2 * 1.0 + 0.5 * 1.0 + 0.0, 2 * 1.5 + 0.0 + 1.0])
    assert got.by_name["exact"] == [0.0, 1.0]


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        (
            {"function": "nonesuch"},
            "[0].function: 'nonesuch' is neither a built-in (math, exact, format, length)",
        ),
        ({"function": "missing.py:f"}, "missing.py is not a file"),
        (
            {"function": "no_such_module_here:f"},
            "no_such_module_here cannot be imported: ModuleNotFoundError",
        ),
        ({"function": "trl.rewards:nothing"}, "trl.rewards has no function 'nothing'"),
        ({"function": "format"}, "[0].args: the format reward needs its regular expression (pattern)"),
        ({"function": "format", "args": {"pattern": "("}}, "pattern '(' is not a regular expression"),
        ({"function": "length", "args": {"max_length": 8, "cache": 8}}, "0 <= cache < max_length, got 8, 8"),
        ({"function": "exact", "args": {"pattern": "x"}}, "pattern: not arguments of the reward function"),
    ],
)
def test_a_reward_that_cannot_be_loaded_is_one_line(tmp_path: Path, spec: dict, fragment: str) -> None:
    with pytest.raises(UserError) as e:
        load_rewards([spec], tmp_path, WHERE)
    message = str(e.value)
    assert message.startswith(WHERE) and fragment in message and "\n" not in message, message


def test_none_is_left_out_of_the_total_and_a_bad_score_names_the_function_and_the_row(tmp_path: Path) -> None:
    (tmp_path / "r.py").write_text(
        "def picky(prompts, completions, completion_ids, **columns):\n"
        "    return [None if c == 'skip' else 1.0 / (c != 'boom') for c in completions]\n"
        "def short(prompts, completions, completion_ids, **columns):\n"
        "    return [1.0]\n"
        "def nan(prompts, completions, completion_ids, **columns):\n"
        "    return [float('nan')] * len(completions)\n"
    )
    picky, short, nan = load_rewards(
        [{"function": f"r.py:{n}"} for n in ("picky", "short", "nan")], tmp_path, WHERE
    )
    got = score([picky], ["p0", "p1"], ["ok", "skip"], [[1], [2]], {})
    assert got.total == [1.0, 0.0] and got.by_name["r.py:picky"] == [1.0, None]
    cases = [
        (picky, ["ok", "ok", "boom"], "reward r.py:picky raised ZeroDivisionError: float division by zero on row 2 (prompt 'p2')"),
        (short, ["a", "b"], "reward r.py:short returned 1 values for 2 completions"),
        (nan, ["a"], "reward r.py:nan gave row 0 nan, not a finite number or None"),
    ]  # fmt: skip
    for reward, completions, message in cases:
        with pytest.raises(RewardError) as e:
            n = len(completions)
            score([reward], [f"p{i}" for i in range(n)], completions, [[1]] * n, {})
        assert str(e.value) == message
