"""Reward functions by name: the built-ins, or any user function by its import path.

A reward function scores a batch of completions against the dataset's answers:

    fn(completions: list[str], answers: list[str], **fields) -> list[float]

where `fields` are the dataset's other columns (one list per column), passed through.

    reward = get_reward("counting", partial=0.2)        # a built-in, with options bound
    reward = get_reward("my_pkg.rewards:length_penalty")  # or "my_pkg.rewards.length_penalty"
    reward = combine([("math", 1.0), (get_reward("format"), 0.1)])
    scores = reward(completions, answers, **columns)

Built-in names: see `BUILTIN_REWARDS` (mmrl/rewards/builtin.py).

`score(fn, ...)` calls a reward and checks what it returns: one finite number per
completion. A reward that raises, returns the wrong count or a NaN/inf score gives a
`RewardError` naming the reward and the completion (the trainer adds step and row).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from collections.abc import Callable, Sequence

from mmrl.errors import one_line
from mmrl.rewards.builtin import BUILTIN_REWARDS

RewardFn = Callable[..., list[float]]

__all__ = ["BUILTIN_REWARDS", "RewardError", "RewardFn", "combine", "get_reward", "reward_name", "score"]


class RewardError(ValueError):
    """A reward function failed or returned unusable scores. `reward` names it, `index`
    is the completion in the batch it was scoring (None when no single one is to blame)."""

    def __init__(self, message: str, *, reward: str, index: int | None = None):
        super().__init__(message)
        self.reward = reward
        self.index = index


def reward_name(fn) -> str:
    return getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", None) or repr(fn)


def score(fn: RewardFn, completions: list[str], answers: list[str], **fields) -> list[float]:
    """`fn`'s scores, checked: one finite float per completion, else a RewardError. When
    the batch call raises, each completion is scored alone to find the one to blame."""
    name = reward_name(fn)
    try:
        scores = fn(completions, answers, **fields)
    except RewardError:
        raise
    except Exception as exc:
        raise RewardError(f"reward {name!r} raised {type(exc).__name__}: {one_line(exc, empty='(no message)')}",
                          reward=name, index=_failing_index(fn, completions, answers, fields)) from exc
    try:
        scores = [float(s) for s in scores]
    except (TypeError, ValueError) as exc:
        raise RewardError(f"reward {name!r} returned something other than numbers "
                          f"({one_line(exc, empty='(no message)')})", reward=name) from None
    if len(scores) != len(completions):
        raise RewardError(f"reward {name!r} returned {len(scores)} scores for {len(completions)} completions",
                          reward=name)
    for index, value in enumerate(scores):
        if not math.isfinite(value):
            raise RewardError(f"reward {name!r} returned {value} (a reward must be a finite number)",
                              reward=name, index=index)
    return scores


def _failing_index(fn: RewardFn, completions, answers, fields) -> int | None:
    for index in range(len(completions)):
        try:
            fn(completions[index:index + 1], answers[index:index + 1],
               **{key: values[index:index + 1] for key, values in fields.items()})
        except Exception:
            return index
    return None


def get_reward(spec: str | RewardFn, **options) -> RewardFn:
    """The reward function named by `spec`, with `options` bound as keyword arguments.

    `spec` is a built-in name, a "package.module:function" or "package.module.function"
    path, or a callable (returned as is). Options must be named parameters of the
    function, so a misspelt option fails here rather than vanishing into `**fields`.
    """
    fn = spec if callable(spec) else _resolve(spec)
    if not options:
        return fn
    _check_options(fn, options, spec)
    bound = functools.partial(fn, **options)
    functools.update_wrapper(bound, fn)  # keeps the name for logs
    return bound


def _resolve(spec: str) -> RewardFn:
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    builtins = ", ".join(sorted(BUILTIN_REWARDS))
    module_name, _, attribute = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(
            f"unknown reward {spec!r}: not a built-in ({builtins}) "
            "and not a 'package.module:function' path"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({error})") from error
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no function {attribute!r}")
    return fn


def _check_options(fn: RewardFn, options: dict, spec) -> None:
    parameters = list(inspect.signature(fn).parameters.values())[2:]  # after completions, answers
    named = {
        p.name for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    unknown = sorted(set(options) - named)
    if unknown:
        name = spec if isinstance(spec, str) else getattr(fn, "__name__", repr(fn))
        raise ValueError(f"reward {name!r} has no option {', '.join(unknown)}; its options: {sorted(named)}")


def combine(components: Sequence[tuple[str | RewardFn, float]]) -> RewardFn:
    """One reward function returning the weighted sum of several: [(fn or spec, weight), ...]."""
    resolved = tuple((get_reward(spec), float(weight)) for spec, weight in components)
    if not resolved:
        raise ValueError("combine needs at least one (reward, weight) pair")

    def combined(completions: list[str], answers: list[str], **fields) -> list[float]:
        total = [0.0] * len(completions)
        for fn, weight in resolved:
            scores = score(fn, completions, answers, **fields)
            total = [t + weight * s for t, s in zip(total, scores)]
        return total

    combined.components = resolved  # each part, for per-reward logging
    return combined
