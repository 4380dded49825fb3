"""The built-in reward functions, looked up by name through `mmrl.rewards.get_reward`.

Every reward function has the same signature:

    fn(completions: list[str], answers: list[str], **fields) -> list[float]

`fields` are the dataset's other columns, one list per column, passed through; a
function uses the ones it knows and ignores the rest. Options (a regex, a tolerance)
are keyword arguments that `get_reward("numeric", tolerance=1e-3)` binds once.

    exact_match  1.0 when equal after normalizing whitespace and case
    numeric      the completion's last number equals the answer within a tolerance
    math         symbolic equivalence with `math_verify`, or `numeric` without it
    format       the completion matches a regex (`pattern` option or per-row field)
    counting     a count 0..10 in digits or words; partial credit for a wrong count
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


BUILTIN_REWARDS = {
    "exact_match": exact_match,
    "numeric": numeric,
    "math": math_equivalent,
    "format": format_match,
    "counting": counting,
}
