"""The order xdist takes the tests in (tests/conftest.py): every test LONGEST names
exists, so a renamed test does not quietly drop back into the middle of the queue.

    .venv/bin/python -m pytest -q tests/test_queue_order.py
"""

import ast
from pathlib import Path

import pytest
from conftest import LONGEST

TESTS = Path(__file__).resolve().parent


@pytest.mark.parametrize("name", LONGEST)
def test_every_longest_test_exists(name):
    path, function = name.split("::")
    tree = ast.parse((TESTS.parent / path).read_text())
    assert function in {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}, name


def test_longest_names_each_test_once():
    assert len(set(LONGEST)) == len(LONGEST)
