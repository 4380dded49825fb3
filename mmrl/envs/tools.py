"""Tools an environment offers the policy, and the parser that finds the policy's calls.

A tool is a plain function `fn(arguments: dict, context: dict) -> content`, where
`context` holds the sample (`context["images"]`: the sample's images at full
resolution, `context["row"]`: the dataset row) and `content` is a message content: a
string, or a list of parts (`{"type": "image", "image": PIL image}` makes the reply an
image message). A tool raises `ToolError` (or any exception) for a bad call; the
environment turns it into an error reply and counts it.

    calls = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>')
    calls[0].name, calls[0].arguments                       # ("calculator", {"expression": "2+3"})
    parse_tool_calls("zoom(x=0.5, y=0.5)", known=["zoom"])   # compact call syntax, known names only

Formats the parser reads (the chat-template formats of the families, then a generic
fallback): `<tool_call>{json}</tool_call>` blocks (Qwen, Hermes), `[TOOL_CALLS][{json}, ...]`
(Mistral), a bare JSON object `{"name": ..., "arguments"|"parameters": {...}}` (Llama 3),
and `name(key=value, ...)` or `name(value)` for a name in `known`.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from mmrl.imports import import_object


class ToolError(ValueError):
    """A tool call that cannot be carried out (unknown tool, bad arguments)."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[[dict, dict], Any]
    description: str = ""

    def __call__(self, arguments: dict, context: dict) -> Any:
        return self.fn(arguments, context)


# -- parsing ------------------------------------------------------------------------------------
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_COMPACT = re.compile(r"\b([A-Za-z_]\w*)\s*\(([^()]*)\)")


def _call_from_json(value: Any) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some templates carry the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ToolError(f"tool {value['name']!r}: arguments are not JSON: {arguments!r}") from None
    if not isinstance(arguments, dict):
        raise ToolError(f"tool {value['name']!r}: arguments must be an object, got {type(arguments).__name__}")
    return ToolCall(value["name"], arguments)


def _compact_arguments(text: str) -> dict[str, Any]:
    """`x=0.5, y=1` -> {"x": 0.5, "y": 1}; a single unnamed value -> {"input": value}."""
    text = text.strip()
    if not text:
        return {}
    if "=" not in text:
        return {"input": _literal(text)}
    out = {}
    for piece in text.split(","):
        key, sep, value = piece.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ToolError(f"cannot read the argument {piece.strip()!r} (write key=value)")
        out[key.strip()] = _literal(value.strip())
    return out


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_tool_calls(text: str, known: Iterable[str] = ()) -> list[ToolCall]:
    """The tool calls in a policy turn, in order (empty: the turn is an answer). A call
    whose JSON is malformed raises `ToolError`, so the environment can say so."""
    tagged = _TAGGED.findall(text)
    if tagged:
        calls = []
        for body in tagged:
            try:
                value = json.loads(body)
            except ValueError:
                raise ToolError(f"tool call is not JSON: {body[:80]!r}") from None
            call = _call_from_json(value)
            if call is None:
                raise ToolError(f"tool call has no name: {body[:80]!r}")
            calls.append(call)
        return calls
    if "[TOOL_CALLS]" in text:
        body = text.split("[TOOL_CALLS]", 1)[1].strip()
        try:
            value = json.loads(body)
        except ValueError:
            raise ToolError(f"tool calls are not JSON: {body[:80]!r}") from None
        values = value if isinstance(value, list) else [value]
        return [c for c in (_call_from_json(v) for v in values) if c is not None]
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            call = _call_from_json(json.loads(stripped))
        except ValueError:
            call = None
        if call is not None:
            return [call]
    names = set(known)
    return [ToolCall(name, _compact_arguments(args)) for name, args in _COMPACT.findall(text) if name in names]


# -- built-in tools --------------------------------------------------------------------------------
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


# The largest integer the calculator computes (about 1200 digits): a policy's `(9**64)**64**...`
# or a long product would otherwise take the machine's memory and time.
CALCULATOR_MAX_BITS = 4096
CALCULATOR_MAX_CHARS = 1000


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _bounded(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ToolError("exponent too large")
        if isinstance(left, int) and isinstance(right, int):
            # Bounded before computing: the size of the result, from the operands' sizes.
            bits = {ast.Pow: abs(left).bit_length() * max(right, 0), ast.Mult: left.bit_length() + right.bit_length()}
            if bits.get(type(node.op), 0) > CALCULATOR_MAX_BITS:
                raise ToolError(f"result too large (above {CALCULATOR_MAX_BITS} bits)")
        try:
            return _bounded(_OPERATORS[type(node.op)](left, right))
        except OverflowError:
            raise ToolError("result too large") from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ToolError(f"not arithmetic: {ast.unparse(node)!r}")


def _bounded(value: float | int) -> float | int:
    if isinstance(value, int) and value.bit_length() > CALCULATOR_MAX_BITS:
        raise ToolError(f"result too large (above {CALCULATOR_MAX_BITS} bits)")
    return value


def calculator(arguments: dict, context: dict) -> str:
    """Evaluates `expression` (numbers, + - * / // % **, parentheses); the result as text."""
    expression = arguments.get("expression", arguments.get("input"))
    if not isinstance(expression, (str, int, float)):
        raise ToolError("calculator needs an 'expression'")
    if len(str(expression)) > CALCULATOR_MAX_CHARS:  # parsing a huge nesting takes the stack and memory
        raise ToolError(f"expression longer than {CALCULATOR_MAX_CHARS} characters")
    try:
        tree = ast.parse(str(expression), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expression!r}") from None
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def zoom(arguments: dict, context: dict) -> list[dict]:
    """A crop of the sample's image at full resolution, as an image reply.

    Arguments (all optional, fractions of the image's width and height): `x`, `y` the
    centre of the crop (default 0.5), `size` its side (default 1: the whole image);
    `image` which of the sample's images (default 0)."""
    images = context.get("images") or []
    index = arguments.get("image", 0)
    if not isinstance(index, int) or not 0 <= index < len(images):
        raise ToolError(f"zoom: no image {index!r} (the sample has {len(images)})")
    try:
        x, y = float(arguments.get("x", 0.5)), float(arguments.get("y", 0.5))
        size = float(arguments.get("size", 1.0))
    except (TypeError, ValueError):
        raise ToolError("zoom: x, y and size must be numbers") from None
    if not (0 <= x <= 1 and 0 <= y <= 1 and 0 < size <= 1):
        raise ToolError("zoom: x and y must lie in [0, 1] and size in (0, 1]")
    image = images[index]
    width, height = image.size
    half_w, half_h = size * width / 2, size * height / 2
    left = min(max(x * width - half_w, 0), width - 2 * half_w)
    top = min(max(y * height - half_h, 0), height - 2 * half_h)
    box = (round(left), round(top), round(left + 2 * half_w), round(top + 2 * half_h))
    if box == (0, 0, width, height):  # the whole image: itself, not a copy (nothing changes an image in place)
        return [{"type": "image", "image": image}]
    return [{"type": "image", "image": image.crop(box)}]


BUILTIN_TOOLS: dict[str, Tool] = {
    "calculator": Tool("calculator", calculator, "calculator(expression): the value of an arithmetic expression"),
    "zoom": Tool("zoom", zoom, "zoom(x, y, size): the image region around (x, y), size a fraction, at full resolution"),
}


def get_tool(spec: str | Tool | Callable) -> Tool:
    """A built-in tool by name, a `Tool`, a function (named after itself), or a
    "package.module:function" path."""
    if isinstance(spec, Tool):
        return spec
    if callable(spec):
        return Tool(spec.__name__, spec, (spec.__doc__ or "").strip().splitlines()[0] if spec.__doc__ else "")
    if spec in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[spec]
    return get_tool(import_object(spec, what="tool", builtins=BUILTIN_TOOLS))


__all__ = ["BUILTIN_TOOLS", "Tool", "ToolCall", "ToolError", "calculator", "get_tool", "parse_tool_calls", "zoom"]
