"""A run's reward functions resolved from their names (`mega_train.rewards`): a built-in, a function
in a Python file beside the run manifest, or one in an importable module; each with its weight and
its bound settings, refused in one line naming its `where` when it cannot be found or called so."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mega_train.rewards.builtin import BUILTINS
from megacore.errors import UserError


@dataclass(frozen=True)
class Reward:
    name: str  # as the manifest gives it: the metrics' `rewards/<name>/mean`
    fn: Callable[..., Sequence[float | None]]
    weight: float = 1.0
    args: dict[str, Any] = field(default_factory=dict)


def load_rewards(specs: Sequence[dict[str, Any]], base: Path, where: str) -> list[Reward]:
    """Each of `specs` (`{"function", "weight", "args"}`, at `where`[i]) as a callable bound to its
    args; `base`: the run manifest's directory, which file paths are relative to."""
    rewards = []
    for i, spec in enumerate(specs):
        at = f"{where}[{i}]"
        name, args = spec["function"], dict(spec.get("args") or {})
        fn = BUILTINS.get(name) or _import(name, base, f"{at}.function")
        if name in BUILTINS:
            _check_builtin(name, args, f"{at}.args")
        _check_binds(fn, args, f"{at}.args", strict=name in BUILTINS)
        rewards.append(Reward(name, functools.partial(fn, **args), float(spec.get("weight", 1.0)), args))
    return rewards


def _import(name: str, base: Path, where: str) -> Callable[..., Sequence[float | None]]:
    module_name, sep, attr = name.rpartition(":")
    if not sep or not module_name or not attr:
        known = ", ".join(BUILTINS)
        raise UserError(f"{name!r} is neither a built-in ({known}) nor FILE.py:NAME nor MODULE:NAME", where)
    try:
        if module_name.endswith(".py"):
            module = _load_file(base / module_name, where)
        else:
            module = importlib.import_module(module_name)
    except UserError:
        raise
    except Exception as e:  # the user's module: any error it raises while importing
        raise UserError(f"{module_name} cannot be imported: {type(e).__name__}: {e}", where) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"{module_name} has no function {attr!r}", where)
    return fn


def _load_file(path: Path, where: str) -> Any:
    if not path.is_file():
        raise UserError(f"{path} is not a file", where)
    spec = importlib.util.spec_from_file_location(f"mega_train_reward_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_builtin(name: str, args: dict[str, Any], where: str) -> None:
    """The built-ins' settings: `format` a regular expression, `length` 0 <= cache < max_length."""
    if name == "format":
        try:
            re.compile(args["pattern"])
        except KeyError:
            raise UserError("the format reward needs its regular expression (pattern)", where) from None
        except (re.error, TypeError) as e:
            raise UserError(f"pattern {args['pattern']!r} is not a regular expression ({e})", where) from None
    if name == "length":
        limit, cache = args.get("max_length"), args.get("cache", 0)
        if not (type(limit) is int and limit > 0 and type(cache) is int and 0 <= cache < limit):
            raise UserError(
                f"the length reward takes max_length > 0 and 0 <= cache < max_length, got {limit!r}, {cache!r}",
                where,
            )


def _check_binds(fn: Callable[..., Any], args: dict[str, Any], where: str, strict: bool) -> None:
    """`args` must be keyword arguments `fn` takes: named ones, or for a user's function any its
    **kwargs takes (a built-in's **kwargs are the columns it ignores)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return  # a callable without a signature to read (a C function): called as it is
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = not strict and any(p.kind is p.VAR_KEYWORD for p in params.values())
    unknown = sorted(set(args) - named) if not takes_any else []
    if unknown:
        raise UserError(f"{', '.join(unknown)}: not arguments of the reward function", where)
