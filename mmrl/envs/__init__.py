"""Environments for multi-turn rollouts: plain Python, registered by name or import path.

An environment holds one sample's episode. The agent loop (`mmrl.rollout.agent`) makes
one per sample and calls

    messages = env.reset(row)                       # the opening conversation of a dataset row
    new_messages, done, reward = env.step(messages) # after each policy turn (the last message)

`step` sees the whole conversation (its last message is the policy's turn, role
"assistant") and returns the messages to append (tool replies, which may hold images),
whether the episode is over, and a reward (None: none; rewards of a trajectory add up,
on top of the recipe's reward function on the final answer, or with
`algo.credit_assignment: turn` each is credited to the policy turns up to the one it
followed: docs/agents.md). Optional integer attributes
`tool_calls` and `tool_errors` are logged as metrics.

    factory = get_environment("tools", tools=["zoom"], max_calls=1)   # a built-in, options bound
    factory = get_environment("my_pkg.envs:Maze")                       # or any class / function
    factory = get_environment("./maze.py:Maze", recipe.folder)           # or a file (mmrl/imports.py)
    env = factory()

Built in (`BUILTIN_ENVIRONMENTS`): `single_turn` (one policy turn: today's rollout) and
`tools` (`mmrl.envs.builtin.ToolEnvironment`: the tools of `mmrl.envs.tools`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from mmrl.imports import import_object

Messages = list[dict[str, Any]]


class Environment(Protocol):
    def reset(self, row: Mapping[str, Any]) -> Messages: ...

    def step(self, messages: Messages) -> tuple[Messages, bool, float | None]: ...


def get_environment(spec: str | Callable, folder: str | Path | None = None, /,
                    **options) -> Callable[[], Environment]:
    """A factory of fresh environments (one per sample) named by `spec`, `options` bound.
    `spec` may be a "path/to/file.py:Class" relative to `folder` (the recipe's folder;
    `mmrl.imports`). Options must be parameters of the environment, so a misspelt one
    fails here."""
    from mmrl.envs.builtin import BUILTIN_ENVIRONMENTS

    factory = spec if callable(spec) else BUILTIN_ENVIRONMENTS.get(spec) or import_object(
        spec, what="environment", folder=folder, builtins=BUILTIN_ENVIRONMENTS)
    if not callable(factory):
        raise ValueError(f"environment {spec!r} is not a class or function")
    try:
        inspect.signature(factory).bind(**options)
    except TypeError as exc:
        raise ValueError(f"environment {spec if isinstance(spec, str) else factory.__name__!r}: {exc}") from None
    return functools.partial(factory, **options)


__all__ = ["Environment", "Messages", "get_environment"]
