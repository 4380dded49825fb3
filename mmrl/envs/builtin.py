"""The built-in environments: one policy turn, and a tool-using loop.

    env = ToolEnvironment(tools=["zoom"], max_calls=1, thumbnail=7)
    messages = env.reset(row)     # the row's prompt; its images shown as 7 px thumbnails
    ...policy answers 'zoom()'...
    reply, done, reward = env.step(messages)   # reply: a tool message holding the full-size image
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from mmrl.envs.tools import Tool, ToolError, get_tool, parse_tool_calls


def _text(message: Mapping[str, Any]) -> str:
    content = message.get("content", "")
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


class SingleTurn:
    """The row's prompt, one policy turn, done: the single-turn rollout as an environment."""

    def reset(self, row: Mapping[str, Any]) -> list[dict]:
        from mmrl.data import to_conversation

        return to_conversation(row)

    def step(self, messages: list[dict]) -> tuple[list[dict], bool, float | None]:
        return [], True, None


class ToolEnvironment:
    """The row's prompt; each policy turn that calls tools gets their replies, a turn
    without a call ends the episode (it is the answer).

    Options: `tools` (built-in names, `Tool`s or import paths), `max_calls` (a call past
    it ends the episode unanswered), `reply_role` (the role of tool replies: "tool", or
    "user" for chat templates without a tool role), `thumbnail` (show the prompt's images
    downscaled to this many pixels on the longer side, then scaled back to their size,
    so detail is lost but the image budget is unchanged; tools see the originals),
    `thumbnail_share` (the share of rows shown as thumbnails, the others at full size:
    chosen by a checksum of the row's first image, so a row is always treated alike),
    `system` (a system message prepended to the prompt), `hide_images` (drop the prompt's
    images: the policy sees them only through a tool), `restate` (follow each tool reply
    with the text of the prompt's last user message), `tool_use_reward` (a shaping reward
    for an answer that follows a tool's reply: exploring the tool pays before reading its
    replies is learned; keep it plus the reward function's partial credit below 1, which
    counts as correct) and `opening_calls` (calls such as "zoom()" the environment makes
    before the policy's first turn: their replies open the conversation, a demonstration
    that is context, not trained on, not counted as the policy's calls)."""

    def __init__(self, tools: Sequence[str | Tool] = ("calculator",), max_calls: int = 4,
                 reply_role: str = "tool", thumbnail: int | None = None, thumbnail_share: float = 1.0,
                 system: str | None = None, restate: bool = False, tool_use_reward: float = 0.0,
                 opening_calls: Sequence[str] = (), hide_images: bool = False):
        self.tools = {t.name: t for t in (get_tool(spec) for spec in tools)}
        if max_calls < 0:
            raise ValueError(f"max_calls must be >= 0, got {max_calls}")
        if thumbnail is not None and thumbnail < 1:
            raise ValueError(f"thumbnail must be a positive number of pixels, got {thumbnail}")
        if not 0 <= thumbnail_share <= 1:
            raise ValueError(f"thumbnail_share must lie in [0, 1], got {thumbnail_share}")
        self.thumbnail_share = thumbnail_share
        self.max_calls = max_calls
        self.reply_role = reply_role
        self.thumbnail = thumbnail
        self.system = system
        self.restate = restate
        self.tool_use_reward = float(tool_use_reward)
        self.answered_tools = 0  # tool calls that got a reply (not an error)
        self.question: list[dict] = []
        self.opening_calls = list(opening_calls)
        self.hide_images = hide_images
        self.tool_calls = 0
        self.tool_errors = 0
        self.context: dict[str, Any] = {}

    def reset(self, row: Mapping[str, Any]) -> list[dict]:
        from mmrl.data import to_conversation

        conversation = to_conversation(row)
        images = [p["image"] for m in conversation if not isinstance(m["content"], str)
                  for p in m["content"] if p.get("type") == "image"]
        self.context = {"row": row, "images": images}
        users = [m for m in conversation if m["role"] == "user"]
        if users:
            content = users[-1]["content"]
            self.question = ([{"type": "text", "text": content}] if isinstance(content, str)
                             else [p for p in content if p.get("type") == "text"])
        if self.thumbnail is not None and images and self._shows_thumbnail(images[0]):
            for message in conversation:
                if not isinstance(message["content"], str):
                    message["content"] = [{**p, "image": self._thumbnail(p["image"])} if p.get("type") == "image"
                                          else p for p in message["content"]]
        if self.hide_images:
            for message in conversation:
                if not isinstance(message["content"], str):
                    message["content"] = [p for p in message["content"] if p.get("type") != "image"]
        if self.system is not None:
            conversation = [{"role": "system", "content": self.system}, *conversation]
        for call in self.opening_calls:
            conversation += self._opening_call(conversation, call)
        return conversation

    def _opening_call(self, conversation: list[dict], call: str) -> list[dict]:
        """A call the environment makes on the policy's behalf before its first turn (an
        assistant message and the replies): a demonstration in the prompt, never trained
        on, not counted in `tool_calls`, not charged to `max_calls`."""
        calls = parse_tool_calls(call, known=self.tools)
        if not calls or any(c.name not in self.tools for c in calls):
            raise ValueError(f"opening_calls: {call!r} is not a call of a tool here ({', '.join(self.tools)})")
        replies = [{"role": self.reply_role, "content": self._restated(self.tools[c.name](c.arguments, self.context))}
                   for c in calls]
        return [{"role": "assistant", "content": call}, *replies]

    def _shows_thumbnail(self, image) -> bool:
        import zlib

        if self.thumbnail_share >= 1:
            return True
        return zlib.crc32(image.tobytes()) / 2**32 < self.thumbnail_share

    def _thumbnail(self, image):
        scale = self.thumbnail / max(image.size)
        if scale >= 1:
            return image
        small = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))))
        return small.resize(image.size)

    def step(self, messages: list[dict]) -> tuple[list[dict], bool, float | None]:
        try:
            calls = parse_tool_calls(_text(messages[-1]), known=self.tools)
        except ToolError as exc:
            return self._error(str(exc))
        if not calls:  # an answer: after a tool's reply, it earns the shaping reward
            return [], True, (self.tool_use_reward if self.tool_use_reward and self.answered_tools else None)
        replies = []
        for call in calls:
            if self.tool_calls >= self.max_calls:
                return [], True, None  # past the budget: the episode ends unanswered
            self.tool_calls += 1
            tool = self.tools.get(call.name)
            if tool is None:
                return self._error(f"unknown tool {call.name!r} (tools: {', '.join(self.tools)})")
            try:
                content = _call_with_limit(tool, call.arguments, self.context, TOOL_TIME_LIMIT_S)
            except Exception as exc:  # a tool's failure is the policy's to see, not the run's
                self.tool_errors += 1
                replies.append({"role": self.reply_role, "content": f"error: {exc}"})
                continue
            self.answered_tools += 1
            replies.append({"role": self.reply_role, "content": self._restated(_cut(content))})
        return replies, False, None

    def _restated(self, content):
        if not self.restate or not self.question:
            return content
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
        return [*parts, *self.question]

    def _error(self, text: str) -> tuple[list[dict], bool, float | None]:
        self.tool_errors += 1
        if self.tool_calls >= self.max_calls:
            return [], True, None
        self.tool_calls += 1
        return [{"role": self.reply_role, "content": f"error: {text}"}], False, None


# The seconds a tool call may run; past it, the call is an error the policy sees. Python code
# stops at once; a long call into C code (a huge power) when it returns.
TOOL_TIME_LIMIT_S = 10.0


def _call_with_limit(tool: Tool, arguments: dict, context: dict, seconds: float):
    """`tool(arguments, context)`, stopped after `seconds`: in the main thread by a timer
    signal (it also interrupts a sleep or a blocking read); elsewhere (signals reach the
    main thread only) in a worker thread that is waited for `seconds`, then stopped by an
    exception raised in it at its next Python instruction."""
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        with _alarm(seconds):
            return tool(arguments, context)
    outcome: dict[str, Any] = {}

    def work():
        try:
            outcome["value"] = tool(arguments, context)
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            outcome["error"] = exc

    worker = threading.Thread(target=work, name=f"mmrl-tool-{tool.name}", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        _raise_in(worker, _ToolTimeout)
        raise ToolError(f"took longer than {seconds:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class _ToolTimeout(BaseException):
    """Raised inside a tool's worker thread past its time (BaseException: a tool's own
    `except Exception` does not swallow it)."""


def _raise_in(thread: threading.Thread, kind: type[BaseException]) -> None:
    import ctypes

    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(kind))


@contextmanager
def _alarm(seconds: float):
    def expired(signum, frame):
        raise _ToolTimeout

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _ToolTimeout:
        raise ToolError(f"took longer than {seconds:g} s") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# The most characters of text a tool's reply passes on to the policy; the rest is cut (and
# the cut said), so a tool that prints megabytes does not fill memory and the context.
TOOL_REPLY_MAX_CHARS = 8192


def _cut(content):
    def cut(text: str) -> str:
        if len(text) <= TOOL_REPLY_MAX_CHARS:
            return text
        return text[:TOOL_REPLY_MAX_CHARS] + f" ... (cut: {len(text) - TOOL_REPLY_MAX_CHARS} more characters)"

    if isinstance(content, str):
        return cut(content)
    return [{**part, "text": cut(part["text"])} if isinstance(part, dict) and isinstance(part.get("text"), str)
            else part for part in content]


BUILTIN_ENVIRONMENTS = {"single_turn": SingleTurn, "tools": ToolEnvironment}

__all__ = ["BUILTIN_ENVIRONMENTS", "SingleTurn", "ToolEnvironment"]
