"""The built-in reward functions, looked up by name through `mmrl.rewards.get_reward`.

Every reward function has the same signature:

    fn(completions: list[str], answers: list[str], **fields) -> list[float]

`fields` are the dataset's other columns and the trainer's fields (prompts, images,
completion_ids: `mmrl.rewards`), one list per column, passed through; a function uses
the ones it knows and ignores the rest. Options (a regex, a tolerance)
are keyword arguments that `get_reward("numeric", tolerance=1e-3)` binds once.

    exact_match  1.0 when equal after normalizing whitespace and case
    numeric      the completion's last number equals the answer within a tolerance
    math         symbolic equivalence with `math_verify`, or `numeric` without it
    format       the completion matches a regex (`pattern` option or per-row field)
    counting     a count 0..10 in digits or words; partial credit for a wrong count
    boxed_math   the last \\boxed{...} of the completion is equivalent to the answer
    think_format `<think>reasoning</think>` then an answer (boxed, tagged or any text)

The table `mmrl.rewards.BUILTIN_REWARDS` names these and two more: `weighted` (a weighted
sum of other rewards, in `mmrl.rewards` beside the combining it uses) and `judge` (a
second model's score, `mmrl.rewards.judge`).
"""

from __future__ import annotations

import math
import re
import threading


DEFAULT_FORMAT = r"<answer>.*?</answer>"

# A plain, thousands-separated, decimal or scientific number, optionally a fraction a/b.
_REAL = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+"
_NUMBER = re.compile(rf"(?P<num>{_REAL})(?:\s*/\s*(?P<den>{_REAL}))?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)

NUMBER_WORDS = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty",
)
_COUNT = re.compile(r"\b(?:\d+|" + "|".join(NUMBER_WORDS) + r")\b", re.IGNORECASE)


def _normalize(text: str) -> str:
    return " ".join(text.split()).casefold()


def last_number(text: str) -> float | None:
    """The last number written in `text` (1,000 and 3/4 included), or None."""
    matches = list(_NUMBER.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    value = float(last["num"].replace(",", ""))
    if last["den"] is not None:
        denominator = float(last["den"].replace(",", ""))
        return value / denominator if denominator else None
    return value


def _same_number(completion: str, answer: str, tolerance: float) -> bool:
    predicted, expected = last_number(completion), last_number(answer)
    if predicted is None or expected is None:
        return False
    return math.isclose(predicted, expected, rel_tol=tolerance, abs_tol=tolerance)


def exact_match(completions: list[str], answers: list[str], **fields) -> list[float]:
    """1.0 when completion and answer are equal after collapsing whitespace and case."""
    return [float(_normalize(c) == _normalize(a)) for c, a in zip(completions, answers, strict=True)]


def numeric(completions: list[str], answers: list[str], *, tolerance: float = 1e-6, **fields) -> list[float]:
    """1.0 when the completion's last number equals the answer's within `tolerance`.

    The tolerance is both relative and absolute (`math.isclose`). The answer's last
    number counts too, so "#### 72"-style answers work unchanged.
    """
    return [float(_same_number(c, a, tolerance)) for c, a in zip(completions, answers, strict=True)]


def math_equivalent(
    completions: list[str], answers: list[str], *, tolerance: float = 1e-6, timeout: int | None = 5, **fields
) -> list[float]:
    """1.0 when the completion's final answer is mathematically equivalent to the answer.

    Uses the `math_verify` package (LaTeX and symbolic equivalence) when it is
    importable. Without it, or for an answer it cannot parse, this falls back to the
    `numeric` reward, which compares only the last number of each text.
    `math_verify` times out (`timeout` seconds) with SIGALRM, which only the main
    thread may use; in any other thread the checks run without a timeout.
    """
    try:
        from math_verify import parse, verify
    except ImportError:
        return numeric(completions, answers, tolerance=tolerance)
    if threading.current_thread() is not threading.main_thread():
        timeout = None
    scores = []
    for completion, answer in zip(completions, answers, strict=True):
        try:
            # A bare LaTeX answer ("\\sqrt{2}") only parses between math delimiters.
            gold = parse(answer, parsing_timeout=timeout) or parse(f"${answer}$", parsing_timeout=timeout)
            if gold:
                correct = verify(gold, parse(completion, parsing_timeout=timeout), timeout_seconds=timeout)
            else:
                correct = _same_number(completion, answer, tolerance)
        except Exception:  # a parser error is a wrong answer, not a crashed training step
            correct = False
        scores.append(float(correct))
    return scores


def format_match(
    completions: list[str], answers: list[str], *, pattern: str | list[str] = DEFAULT_FORMAT, **fields
) -> list[float]:
    """1.0 when `re.search(pattern, completion)` finds a match (DOTALL: `.` spans lines).

    `pattern` is one regex for all rows (an option) or a dataset column of per-row
    regexes (a field). Anchor it with ^...$ to require that nothing else is written.
    """
    patterns = [pattern] * len(completions) if isinstance(pattern, str) else list(pattern)
    return [
        float(re.search(p, c, re.DOTALL) is not None)
        for c, p in zip(completions, patterns, strict=True)
    ]


def parse_count(text: str) -> int | None:
    """The last count in `text`, written in digits or as a word up to "twenty", or None.

    Inside an <answer>...</answer> tag only the tag's content is read.
    """
    tagged = _ANSWER_TAG.findall(text)
    found = _COUNT.findall(tagged[-1] if tagged else text)
    if not found:
        return None
    token = found[-1].lower()
    return int(token) if token.isdigit() else NUMBER_WORDS.index(token)


def counting(
    completions: list[str], answers: list[str], *, partial: float = 0.2, max_count: int = 10, **fields
) -> list[float]:
    """1.0 for the right count, `partial` for a wrong count in 0..max_count, else 0.0.

    Counts may be digits or number words ("3" or "three"), in the answer as well.
    The partial credit rewards answering in the expected form while still wrong.
    """
    scores = []
    for completion, answer in zip(completions, answers, strict=True):
        predicted, expected = parse_count(completion), parse_count(answer)
        if predicted is not None and predicted == expected:
            scores.append(1.0)
        elif predicted is not None and 0 <= predicted <= max_count:
            scores.append(float(partial))
        else:
            scores.append(0.0)
    return scores


# -- R1-style math: a boxed final answer after a <think> block --------------------------------

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced,
    or None. `\\boxed 5` (no braces) gives "5"."""
    matches = list(_BOXED.finditer(text))
    for match in reversed(matches):
        start = match.end()
        if start < len(text) and text[start] == "{":
            depth = 0
            for i in range(start, len(text)):
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                if depth == 0:
                    return text[start + 1:i].strip()
            continue  # unclosed: try an earlier box
        word = re.match(r"[^\s$]+", text[start:])
        if word and match.group().endswith(" "):
            return word.group()
    return None


# LaTeX that does not change a final answer's value: spacing, sizing, degree and percent
# signs, display-style fractions.
_LATEX_NOISE = (
    (re.compile(r"\\(?:left|right|displaystyle|!|,|;|:|quad|qquad)"), ""),
    (re.compile(r"\\[dt]frac"), r"\\frac"),
    (re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°"), ""),
    (re.compile(r"\\?%"), ""),
    (re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}"), r"\1"),
    (re.compile(r"\$"), ""),
)
_FRAC = re.compile(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}|\\frac\s*(\d)\s*(\d)")
_SQRT = re.compile(r"\\sqrt\s*\{([^{}]*)\}|\\sqrt\s*(\d+)")


def normalize_math_answer(text: str) -> str:
    """A final answer with its LaTeX noise removed, spaces dropped and case folded, for
    comparing strings: `x = \\dfrac{1}{2}\\,\\text{cm}` -> `\\frac{1}{2}cm`, `60^\\circ` -> `60`,
    `1,000` -> `1000`. Fractions and roots stay LaTeX for `evaluate_math_answer`."""
    text = text.strip()
    for pattern, replacement in _LATEX_NOISE:
        text = pattern.sub(replacement, text)
    text = re.sub(r"\s+", "", text).rstrip(".")
    text = re.sub(r"^[a-zA-Z]\w*=(?!=)", "", text)  # "x=5" -> "5"
    if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    return text.casefold()


def evaluate_math_answer(text: str) -> float | None:
    """The numeric value of a normalized answer built from numbers, + - * / ^, fractions,
    square roots, pi and parentheses; None for anything else (a variable, a set, text)."""
    import ast

    expression = text
    for _ in range(8):  # innermost first: nested fractions and roots
        replaced = _FRAC.sub(lambda m: f"(({m[1] or m[3]})/({m[2] or m[4]}))", expression)
        replaced = _SQRT.sub(lambda m: f"sqrt({m[1] or m[2]})", replaced)
        if replaced == expression:
            break
        expression = replaced
    expression = (expression.replace("\\pi", "pi").replace("\\cdot", "*").replace("\\times", "*")
                  .replace("{", "(").replace("}", ")").replace("^", "**"))
    expression = re.sub(r"(?<=[\d)])(?=[a-z(])", "*", expression)  # 2sqrt(3) -> 2*sqrt(3)
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        return None
    constants = {"pi": math.pi}
    operators = {ast.Add: float.__add__, ast.Sub: float.__sub__, ast.Mult: float.__mul__,
                 ast.Div: float.__truediv__, ast.Pow: float.__pow__}

    def value(node) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.Name) and node.id in constants:
            return constants[node.id]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in operators:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return operators[type(node.op)](left, right)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "sqrt" and len(node.args) == 1:
            return math.sqrt(value(node.args[0]))
        raise ValueError("not a number")

    try:
        result = value(tree.body)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return result if isinstance(result, float) and math.isfinite(result) else None


def equivalent_by_normalizing(predicted: str, expected: str, tolerance: float = 1e-6) -> bool:
    """Equal after `normalize_math_answer`, or of equal value by `evaluate_math_answer`."""
    a, b = normalize_math_answer(predicted), normalize_math_answer(expected)
    if not a or not b:
        return False
    if a == b:
        return True
    x, y = evaluate_math_answer(a), evaluate_math_answer(b)
    return x is not None and y is not None and math.isclose(x, y, rel_tol=tolerance, abs_tol=tolerance)


def _math_verify_equivalent(predicted: str, expected: str, timeout: int | None) -> bool | None:
    """math_verify's verdict on two bare answers, or None when it is not installed or
    cannot parse the expected answer."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    if threading.current_thread() is not threading.main_thread():
        timeout = None  # its timeout uses SIGALRM, which only the main thread may set
    try:
        gold = parse(f"${expected}$", parsing_timeout=timeout)
        if not gold:
            return None
        return bool(verify(gold, parse(f"${predicted}$", parsing_timeout=timeout), timeout_seconds=timeout))
    except Exception:  # a parser error is a wrong answer, not a crashed training step
        return False


def boxed_math(
    completions: list[str], answers: list[str], *, tolerance: float = 1e-6, timeout: int | None = 5, **fields
) -> list[float]:
    """1.0 when the completion's last `\\boxed{...}` is equivalent to the answer, else 0.0.

    A completion without a box scores 0 even if the right number appears elsewhere.
    Equivalence is `math_verify`'s (symbolic: `\\frac{1}{2}` = 0.5, `2\\sqrt{3}` = `\\sqrt{12}`,
    `60^\\circ` = 60) when it is installed and reads the answer; otherwise, or when it
    says no, `equivalent_by_normalizing` decides (LaTeX noise removed, then the strings
    or their numeric values compared), so a parser gap never fails a plainly equal answer.
    An answer written as `\\boxed{...}` itself is unboxed first.
    """
    scores = []
    for completion, answer in zip(completions, answers, strict=True):
        predicted = last_boxed(completion)
        expected = last_boxed(answer) or answer
        if predicted is None or not expected.strip():
            scores.append(0.0)
            continue
        correct = equivalent_by_normalizing(predicted, expected, tolerance)
        if not correct:
            correct = bool(_math_verify_equivalent(predicted, expected, timeout))
        scores.append(float(correct))
    return scores


_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_AFTER_THINK = {
    "boxed": lambda rest: last_boxed(rest) is not None,
    "tag": lambda rest: re.fullmatch(r"\s*<answer>.*?\S.*?</answer>\s*", rest, re.DOTALL) is not None,
    "any": lambda rest: bool(rest.strip()),
}


def think_format(completions: list[str], answers: list[str], *, answer: str = "boxed", **fields) -> list[float]:
    """1.0 when the completion is `<think>reasoning</think>` followed by its answer.

    The completion must open with the think block (leading whitespace aside), hold
    exactly one, with non-blank reasoning, and then `answer`: "boxed" (a `\\boxed{...}`
    after the block), "tag" (only `<answer>...</answer>` after it, as in R1-V) or
    "any" (any non-blank text).
    """
    if answer not in _AFTER_THINK:
        raise ValueError(f"think_format: answer must be one of {', '.join(_AFTER_THINK)}, got {answer!r}")
    check = _AFTER_THINK[answer]
    scores = []
    for completion in completions:
        text = completion.lstrip()
        ok = (text.startswith(_THINK_OPEN) and text.count(_THINK_OPEN) == 1 and text.count(_THINK_CLOSE) == 1)
        if ok:
            reasoning, _, rest = text[len(_THINK_OPEN):].partition(_THINK_CLOSE)
            ok = bool(reasoning.strip()) and check(rest)
        scores.append(float(ok))
    return scores
