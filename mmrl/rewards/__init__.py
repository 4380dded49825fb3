"""Reward functions by name: the built-ins, or any user function by its file or import path.

A reward function scores a batch of completions:

    fn(completions: list[str], answers: list[str], **fields) -> list[float]

`fields` are the dataset's other columns (one list per column) and what the trainer adds:
`prompts` (each completion's prompt conversation, images decoded), `images` and `videos`
(each completion's media, PIL images), `completion_ids` (its token ids). A function gets
only the keywords it names (all of them with `**kwargs`), so one that names none of them
keeps working. TRL's reward functions (`fn(prompts, completions, **kwargs)`, everything
by keyword, `answers` a keyword too) are called the way TRL calls them; `call_reward` has
the rule.

    reward = get_reward("counting", partial=0.2)           # a built-in, with options bound
    reward = get_reward("my_pkg.rewards:length_penalty")    # or "my_pkg.rewards.length_penalty"
    reward = get_reward("./my_rewards.py:graded", folder)   # a file, relative to `folder` (mmrl/imports.py)
    reward = combine([("math", 1.0), (get_reward("format"), 0.1)])
    scores = reward(completions, answers, **columns)
    scores, parts = score_parts(reward, completions, answers, **columns)  # parts: {"math": [...], ...}

Built-in names: see `BUILTIN_REWARDS` (the functions in mmrl/rewards/builtin.py, `weighted` here,
`judge` in mmrl/rewards/judge.py).

`score(fn, ...)` calls a reward and checks what it returns: one finite number per
completion. A reward that raises, returns the wrong count or a NaN/inf score gives a
`RewardError` naming the reward and the completion (the trainer adds step and row).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mmrl.errors import one_line, raised
from mmrl.imports import import_object, split_spec
from mmrl.rewards.builtin import (boxed_math, counting, exact_match, format_match, math_equivalent, numeric,
                                  think_format)

RewardFn = Callable[..., list[float]]

# The keywords the trainer offers besides the dataset's columns (docs/training.md#rewards).
TRAINER_FIELDS = ("prompts", "images", "videos", "completion_ids")

__all__ = ["BUILTIN_REWARDS", "TRAINER_FIELDS", "CombinedReward", "RewardError", "RewardFn", "RewardPart",
           "accepts", "call_reward", "combine", "get_reward", "missing_fields", "reward_name", "score", "score_parts"]


class RewardError(ValueError):
    """A reward function failed or returned unusable scores. `reward` names it, `index`
    is the completion in the batch it was scoring (None when no single one is to blame)."""

    def __init__(self, message: str, *, reward: str, index: int | None = None):
        super().__init__(message)
        self.reward = reward
        self.index = index


def reward_name(fn) -> str:
    return getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", None) or repr(fn)


# -- calling a reward ---------------------------------------------------------------------------

def _parameters(fn) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a callable without a signature: call it the old way
        return None


def accepts(fn: RewardFn, name: str) -> bool:
    """Whether `fn` (or a part of a combined reward) takes the keyword `name`: it names it
    or takes **kwargs. The trainer builds costly fields (decoded images) only then."""
    if isinstance(fn, CombinedReward):
        return any(accepts(part.fn, name) for part in fn.components)
    parameters = _parameters(fn)
    if parameters is None:
        return True
    return any(p.kind is p.VAR_KEYWORD or (p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
               for p in parameters)


def _plan(parameters: list[inspect.Parameter], offered: set[str]) -> tuple[bool, bool, set[str] | None]:
    """How to call a function with these parameters when `offered` names the fields
    besides completions (answers included): (completions positionally, answers
    positionally, the keywords it takes; None: any, it has **kwargs). The trainer's field
    names count as offered even where a direct caller leaves them out."""
    offered = offered | set(TRAINER_FIELDS)
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords = None if any(p.kind is p.VAR_KEYWORD for p in parameters) else {
        p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if positional and positional[0] in offered:  # TRL's order: prompts first, all by keyword
        return False, False, keywords
    second = positional[1] if len(positional) > 1 else None
    answers_second = (second == "answers" or second not in offered) if second is not None else \
        any(p.kind is p.VAR_POSITIONAL for p in parameters)
    if keywords is not None:
        keywords = keywords - set(positional[:2 if answers_second else 1])
    return True, answers_second, keywords


def call_reward(fn: RewardFn, completions: list, answers: list, **fields):
    """`fn` called with the arguments its signature takes.

    mmrl's convention: the first positional parameter gets `completions` and the second,
    unless it is named after another field, `answers`; the other fields go by keyword,
    those the function names (all with **kwargs). TRL's: a function whose first
    parameter is named after a field (`prompts`) gets everything by keyword, `answers`
    included, as TRL's GRPOTrainer calls `reward_func(prompts=, completions=, ...)`.
    """
    parameters = _parameters(fn)
    if parameters is None:
        return fn(completions, answers, **fields)
    offered = {"answers": answers, **{k: v for k, v in fields.items() if k not in ("completions", "answers")}}
    completions_first, answers_second, keywords = _plan(parameters, set(offered))
    args = []
    if completions_first:
        args.append(completions)
    else:
        offered["completions"] = completions
    if answers_second:
        args.append(answers)
        offered.pop("answers")
    return fn(*args, **{k: v for k, v in offered.items() if keywords is None or k in keywords})


def missing_fields(fn: RewardFn, available: set[str]) -> list[str]:
    """The required parameters of `fn` (or of a combined reward's parts) that no field
    in `available` (dataset columns and `TRAINER_FIELDS`) fills: a call would fail."""
    if isinstance(fn, CombinedReward):
        return sorted({name for part in fn.components for name in missing_fields(part.fn, available)})
    parameters = _parameters(fn)
    if parameters is None:
        return []
    offered = {"answers", *available}
    completions_first, answers_second, _ = _plan(parameters, offered)
    filled = offered | ({"completions"} if not completions_first else set())
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_position = {p.name for p in positional[:int(completions_first) + int(answers_second)]}
    return [p.name for p in parameters
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            and p.name not in by_position and p.name not in filled]


def score(fn: RewardFn, completions: list[str], answers: list[str], **fields) -> list[float]:
    """`fn`'s scores, checked: one finite float per completion, else a RewardError. When
    the batch call raises, each completion is scored alone to find the one to blame."""
    name = reward_name(fn)
    try:
        scores = call_reward(fn, completions, answers, **fields)
    except RewardError:
        raise
    except Exception as exc:
        raise RewardError(f"reward {name!r} raised {raised(exc)}",
                          reward=name, index=_failing_index(fn, completions, answers, fields)) from exc
    return _checked(scores, len(completions), name)


def _checked(scores, count: int, name: str) -> list[float]:
    try:
        scores = [float(s) for s in scores]
    except (TypeError, ValueError) as exc:
        raise RewardError(f"reward {name!r} returned something other than numbers "
                          f"({one_line(exc, empty='(no message)')})", reward=name) from None
    if len(scores) != count:
        raise RewardError(f"reward {name!r} returned {len(scores)} scores for {count} completions", reward=name)
    for index, value in enumerate(scores):
        if not math.isfinite(value):
            raise RewardError(f"reward {name!r} returned {value} (a reward must be a finite number)",
                              reward=name, index=index)
    return scores


def _failing_index(fn: RewardFn, completions, answers, fields) -> int | None:
    for index in range(len(completions)):
        try:
            call_reward(fn, completions[index:index + 1], answers[index:index + 1],
                        **{key: values[index:index + 1] for key, values in fields.items()})
        except Exception:
            return index
    return None


def score_parts(fn: RewardFn, completions: list[str], answers: list[str],
                **fields) -> tuple[list[float], dict[str, list[float]]]:
    """`score`, and the checked scores of each part of a combined reward by the part's
    name ({} for a plain one): what the trainer logs as `reward/<part>`."""
    if isinstance(fn, CombinedReward):
        return fn.score_parts(completions, answers, **fields)
    return score(fn, completions, answers, **fields), {}


# -- finding a reward ---------------------------------------------------------------------------

def get_reward(spec: str | RewardFn, folder: str | Path | None = None, /, **options) -> RewardFn:
    """The reward function named by `spec`, with `options` bound as keyword arguments.

    `spec` is a built-in name, a "package.module:function" or "package.module.function"
    path, a "path/to/file.py:function" (relative to `folder`, the recipe's folder, else
    the current one; `mmrl.imports`), or a callable (returned as is). A module beside
    `folder` imports too. Options must be named parameters of the function, so a
    misspelt option fails here rather than vanishing into `**fields`.
    """
    fn = spec if callable(spec) else _resolve(spec, folder)
    if fn is BUILTIN_REWARDS["weighted"]:
        _check_options(fn, options, spec)
        return weighted_reward(options["components"], folder) if "components" in options else fn
    if not options:
        return fn
    _check_options(fn, options, spec)
    bound = functools.partial(fn, **options)
    functools.update_wrapper(bound, fn)  # keeps the name for logs
    return bound


def _resolve(spec: str, folder: str | Path | None) -> RewardFn:
    if spec in BUILTIN_REWARDS:
        entry = BUILTIN_REWARDS[spec]
        return import_object(entry, what="reward", kind="function") if isinstance(entry, str) else entry
    fn = import_object(spec, what="reward", folder=folder, builtins=BUILTIN_REWARDS, kind="function")
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {type(fn).__name__} is not a function")
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


# -- combined rewards ---------------------------------------------------------------------------

@dataclass(frozen=True)
class RewardPart:
    name: str  # its metric is `reward/<name>`
    fn: RewardFn
    weight: float


class CombinedReward:
    """The weighted sum of several rewards, each scored (and checked) on its own, so each
    part's scores are there to log: `score_parts` returns them by name."""

    def __init__(self, components: Sequence[RewardPart], name: str = "combined"):
        if not components:
            raise ValueError("combine needs at least one (reward, weight) pair")
        self.components = tuple(components)
        self.__name__ = name

    def __call__(self, completions: list[str], answers: list[str], **fields) -> list[float]:
        return self.score_parts(completions, answers, **fields)[0]

    def score_parts(self, completions: list[str], answers: list[str],
                    **fields) -> tuple[list[float], dict[str, list[float]]]:
        total = [0.0] * len(completions)
        parts = {}
        for part in self.components:
            scores = score(part.fn, completions, answers, **fields)
            parts[part.name] = scores
            total = [t + part.weight * s for t, s in zip(total, scores)]
        return _checked(total, len(completions), self.__name__), parts

    def __repr__(self) -> str:
        return f"{self.__name__}({', '.join(f'{p.weight} {p.name}' for p in self.components)})"


def _part_names(names: Sequence[str]) -> list[str]:
    """Distinct metric names: a spec's function name ("dir/r.py:graded" -> "graded"); a
    name that repeats gets _2, _3; the trainer's own reward/* names are avoided."""
    taken = {"mean", "std", "accuracy"}
    out = []
    for name in names:
        short = split_spec(name)[1] or name
        unique, count = short, 1
        while unique in taken:
            count += 1
            unique = f"{short}_{count}"
        taken.add(unique)
        out.append(unique)
    return out


def combine(components: Sequence[tuple[str | RewardFn, float]], folder: str | Path | None = None, *,
            name: str = "combined") -> CombinedReward:
    """One reward returning the weighted sum of several: [(fn or spec, weight), ...]."""
    resolved = [(get_reward(spec, folder), float(weight), spec) for spec, weight in components]
    names = _part_names([spec if isinstance(spec, str) else reward_name(fn) for fn, _, spec in resolved])
    return CombinedReward([RewardPart(n, fn, w) for n, (fn, w, _) in zip(names, resolved)], name=name)


def weighted_reward(components, folder: str | Path | None = None) -> CombinedReward:
    """The `weighted` built-in as a recipe writes it: [{name, weight, options}, ...]."""
    if not isinstance(components, (list, tuple)) or not components:
        raise ValueError("weighted: components must be a non-empty list of {name, weight, options}")
    parts = []
    for i, component in enumerate(components):
        if not isinstance(component, dict) or "name" not in component or "weight" not in component:
            raise ValueError(f"weighted: components[{i}] must be a mapping with name and weight, got {component!r}")
        unknown = set(component) - {"name", "weight", "options"}
        if unknown:
            raise ValueError(f"weighted: components[{i}] has unknown key(s) {', '.join(sorted(unknown))}")
        if isinstance(component["weight"], bool) or not isinstance(component["weight"], (int, float)):
            raise ValueError(f"weighted: components[{i}].weight must be a number, got {component['weight']!r}")
        parts.append((component["name"], get_reward(component["name"], folder, **(component.get("options") or {})),
                      component["weight"]))
    names = _part_names([name if isinstance(name, str) else reward_name(fn) for name, fn, _ in parts])
    return CombinedReward([RewardPart(n, fn, float(w)) for n, (_, fn, w) in zip(names, parts)], name="weighted")


def weighted(completions: list[str], answers: list[str], *, components: list[dict], **fields) -> list[float]:
    """The weighted sum of other rewards, configured in a recipe:

        reward:
          name: weighted
          options:
            components:
              - {name: boxed_math, weight: 0.9}
              - {name: think_format, weight: 0.1, options: {answer: boxed}}

    Each component is a reward name (built-in or dotted path), a weight and its options.
    With weights summing to 1, a fully right completion scores exactly 1.0.
    Each part's mean is logged as `reward/<name>` (`mmrl.rewards.score_parts`).
    """
    return weighted_reward(components)(completions, answers, **fields)


# Built-ins by name, in the order the docs list them. The judge builds a model through
# the engine and a rollout backend, and the engine imports the recipe schema, whose checks
# import this package: the judge is named by import path and imported on first use, so
# this package never imports the engine (no import cycle; tests/test_core_rules.py).
BUILTIN_REWARDS: dict[str, RewardFn | str] = {
    "exact_match": exact_match,
    "numeric": numeric,
    "math": math_equivalent,
    "format": format_match,
    "counting": counting,
    "boxed_math": boxed_math,
    "think_format": think_format,
    "weighted": weighted,
    "judge": "mmrl.rewards.judge:judge",
}
