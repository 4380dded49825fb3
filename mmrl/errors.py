"""Errors as one line: what a warning, a table cell or a wrapping error quotes of a cause.

    one_line(exc)                      # "first line of the message", or "KeyError" if blank
    one_line(exc, typed=True)          # "KeyError: first line of the message"
    one_line(exc, 300, typed=True)     # the same, cut to 300 characters ending in "..."
    one_line(exc, typed=True, whole=True)  # every line of the message, whitespace collapsed

Two presets name the forms several modules quote a cause in:

    whole_cause(exc)    # "ValidationError: every line of the message" (a field is often on line 2)
    raised(exc)         # "KeyError: first line", a blank message as "(no message)"
"""

from __future__ import annotations


def one_line(source: BaseException | str, limit: int | None = None, *, typed: bool = False,
             empty: str | None = None, whole: bool = False) -> str:
    """The first line of an exception's stripped message (or of a stripped text); with
    `whole`, all of it, each run of whitespace one space (a validation error's field is
    often on its second line).

    `typed` puts the exception's type name first (`Type: line`, no dangling ": " where the
    line is blank or ends in one); untyped, a blank message reads as `empty` (default: the
    type name). `limit` cuts a longer result to `limit` characters, the last three "...".
    """
    name = "" if isinstance(source, str) else type(source).__name__
    text = str(source).strip()
    line = " ".join(text.split()) if whole else (text.splitlines()[0] if text else "")
    if typed and name:
        line = f"{name}: {line}".rstrip(": ")
    elif not line:
        line = name if empty is None else empty
    return line if limit is None or len(line) <= limit else line[: limit - 3] + "..."


def whole_cause(exc: BaseException, limit: int | None = None) -> str:
    """The type and the whole message on one line: what a failed plugin load or a config
    class that rejects values says (a validation error names the field on a later line)."""
    return one_line(exc, limit, typed=True, whole=True)


def raised(exc: BaseException) -> str:
    """`Type: first line`, a blank message read as `(no message)`: what user code (a reward,
    an imported file) raised, quoted in the error that wraps it."""
    return f"{type(exc).__name__}: {one_line(exc, empty='(no message)')}"
