"""Benchmark figures live in bench/results/ and docs/performance.md; a comment or a
docstring in mmrl/ names the bench or doc that holds one instead of quoting it, so a
re-measurement changes one place and no comment goes stale (issue 29); nor does it send the
reader to a commit message for one."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

MMRL = Path(__file__).resolve().parents[1] / "mmrl"

# A measured time, rate or speed-up: "0.444 s a step", "7.9 ms", "79.9k tok/s", "2.46x",
# "9-18x faster".
FIGURE = re.compile(r"\b\d+(\.\d+)? ?(ms\b|s a step|k? ?tok(ens)?/s)|\b\d+\.\d+x\b|\b\d+(-\d+)?x (faster|slower)")


def _prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every string that stands alone (a docstring)."""
    out, previous = [], None
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            out.append((token.start[0], token.string))
        elif token.type == tokenize.STRING and (previous is None or previous.type in (
                tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT)):
            out.append((token.start[0], token.string))
        if token.type not in (tokenize.COMMENT,):
            previous = token
    return out


def test_no_comment_in_mmrl_quotes_a_benchmark_figure():
    quoted = []
    for path in sorted(MMRL.rglob("*.py")):
        for line, text in _prose(path.read_text()):
            for offset, row in enumerate(text.splitlines()):
                if FIGURE.search(row):
                    quoted.append(f"{path.relative_to(MMRL.parent)}:{line + offset}: {row.strip()[:100]}")
    assert not quoted, "name the bench or doc that holds the figure instead:\n" + "\n".join(quoted)


def test_the_pattern_finds_a_quoted_figure():
    assert FIGURE.search("went from 0.595 s to 0.444 s a step") and FIGURE.search("1.77 ms against 2.05")
    assert FIGURE.search("2.46x the padded update") and FIGURE.search("79.9k tok/s")
    assert FIGURE.search("the 2-thread step 9-18x faster with it")
    assert not FIGURE.search("2^27 is 1.5 GiB of them") and not FIGURE.search("4x the chunk")


# A commit message is no place a reader can find a figure from the code: the bench result or
# the doc that quotes it is.
COMMIT = re.compile(r"\bcommit [0-9a-f]{7,40}\b")


def test_no_comment_in_mmrl_sends_the_reader_to_a_commit_message():
    pointing = [f"{path.relative_to(MMRL.parent)}:{line + offset}: {row.strip()[:100]}"
                for path in sorted(MMRL.rglob("*.py")) for line, text in _prose(path.read_text())
                for offset, row in enumerate(text.splitlines()) if COMMIT.search(row)]
    assert not pointing, "name the bench result or doc that holds it instead:\n" + "\n".join(pointing)


def test_the_pattern_finds_a_commit_named_as_the_source():
    assert COMMIT.search("and faster (an H200 run: commit 4b4ca48's message)")
    assert not COMMIT.search("commit the run folder") and not COMMIT.search("RGB images")
