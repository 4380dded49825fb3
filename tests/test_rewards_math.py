"""R1-style math rewards on hand-written completions: the boxed answer's equivalence
(with math_verify and with the fallback normalizer), the <think> format, and their
weighted combination as recipes configure it."""

import importlib.util
import sys

import pytest

from mmrl.rewards import get_reward
from mmrl.rewards.builtin import equivalent_by_normalizing, evaluate_math_answer, last_boxed

THOUGHT = "<think>The two legs are 3 and 4, so the hypotenuse is 5.</think>"

# (completion, answer, right?) written as a policy would write them.
BOXED_CASES = [
    (f"{THOUGHT} The answer is $\\boxed{{5}}$.", "5", True),
    (f"{THOUGHT} So $x = \\boxed{{\\frac{{1}}{{2}}}}$", "0.5", True),
    ("<think>half</think> \\boxed{\\dfrac{1}{2}}", "1/2", True),
    ("<think>r</think> \\boxed{2\\sqrt{3}}", "\\sqrt{12}", True),
    ("<think>r</think> \\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", True),
    ("<think>r</think> the angle is \\boxed{60^\\circ}", "60", True),
    ("<think>r</think> \\boxed{1,000}", "1000", True),
    ("<think>r</think> \\boxed{x = 5}", "5", True),
    ("first \\boxed{4}, on second thought \\boxed{5}", "5", True),   # the last box counts
    ("first \\boxed{5}, on second thought \\boxed{4}", "5", False),
    (f"{THOUGHT} The answer is 5.", "5", False),                     # right number, no box
    ("<think>r</think> \\boxed{7}", "5", False),
    ("<think>r</think> \\boxed{}", "5", False),
    ("<think>r</think> \\boxed{\\frac{1}{3}}", "0.5", False),
    ("<think>r</think> \\boxed{5}", "\\boxed{5}", True),             # a boxed ground truth is unboxed
]


@pytest.mark.parametrize("completion, answer, right", BOXED_CASES)
def test_boxed_math(completion, answer, right):
    assert get_reward("boxed_math")([completion], [answer]) == [float(right)]


@pytest.mark.parametrize("completion, answer, right", BOXED_CASES)
def test_boxed_math_without_math_verify(monkeypatch, completion, answer, right):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes the import fail
    assert get_reward("boxed_math")([completion], [answer]) == [float(right)]


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="needs math_verify")
def test_boxed_math_uses_math_verify_for_symbolic_answers(monkeypatch):
    completion, answer = "<think>r</think> \\boxed{x^2 + 2x + 1}", "(x+1)^2"
    assert get_reward("boxed_math")([completion], [answer]) == [1.0]
    monkeypatch.setitem(sys.modules, "math_verify", None)  # the normalizer cannot expand it
    assert get_reward("boxed_math")([completion], [answer]) == [0.0]


def test_last_boxed_balances_braces_and_skips_an_unclosed_box():
    assert last_boxed("\\boxed{\\frac{a}{b}} and \\boxed{oops") == "\\frac{a}{b}"
    assert last_boxed("\\fbox{3}") == "3"
    assert last_boxed("\\boxed 12 apples") == "12"
    assert last_boxed("no box here") is None


def test_normalizer_values():
    assert evaluate_math_answer("\\frac{\\sqrt{3}}{2}") == pytest.approx(3 ** 0.5 / 2)
    assert evaluate_math_answer("2^{10}") == 1024.0
    assert evaluate_math_answer("x+1") is None
    assert evaluate_math_answer("2^{999999}") is None  # no runaway exponent
    assert equivalent_by_normalizing("50\\%", "50")
    assert equivalent_by_normalizing("\\text{(B)}", "(b)")
    assert not equivalent_by_normalizing("", "")


THINK_CASES = [
    ("<think>3 + 4 = 7</think> so \\boxed{7}", "boxed", True),
    ("  \n<think>3 + 4 = 7</think>\n\\boxed{7}", "boxed", True),
    ("3 + 4 = 7</think> \\boxed{7}", "boxed", False),          # no opening tag
    ("Sure! <think>3 + 4</think> \\boxed{7}", "boxed", False),  # text before the block
    ("<think>   </think> \\boxed{7}", "boxed", False),          # blank reasoning
    ("<think>a</think><think>b</think> \\boxed{7}", "boxed", False),
    ("<think>3 + 4 = 7</think> 7", "boxed", False),             # no box after the block
    ("<think>\\boxed{7}</think> seven", "boxed", False),        # the box is inside the block
    ("<think>count</think><answer>3</answer>", "tag", True),
    ("<think>count</think><answer>3</answer> extra", "tag", False),
    ("<think>count</think> three", "any", True),
    ("<think>count</think>", "any", False),
]


@pytest.mark.parametrize("completion, answer, right", THINK_CASES)
def test_think_format(completion, answer, right):
    assert get_reward("think_format", answer=answer)([completion], ["unused"]) == [float(right)]


def test_think_format_rejects_an_unknown_answer_kind():
    with pytest.raises(ValueError, match="think_format: answer must be one of boxed, tag, any"):
        get_reward("think_format", answer="json")(["x"], ["y"])


def test_weighted_combination_as_a_recipe_writes_it():
    reward = get_reward("weighted", components=[
        {"name": "boxed_math", "weight": 0.9},
        {"name": "think_format", "weight": 0.1, "options": {"answer": "boxed"}},
    ])
    completions = [
        "<think>3 + 4 = 7</think> \\boxed{7}",   # right and well formed
        "<think>3 + 4 = 8</think> \\boxed{8}",   # wrong, well formed
        "\\boxed{7}",                            # right, no reasoning block
        "seven",                                 # neither
    ]
    assert get_reward("weighted", components=[{"name": "think_format", "weight": 1.0}])(completions, ["7"] * 4) == [
        1.0, 1.0, 0.0, 0.0]
    assert reward(completions, ["7"] * 4) == pytest.approx([1.0, 0.1, 0.9, 0.0])
    assert reward(completions[:1], ["7"])[0] >= 1.0  # counts as accurate in reward/accuracy


def test_weighted_passes_fields_and_names_bad_components():
    reward = get_reward("weighted", components=[{"name": "format", "weight": 2.0}])
    assert reward(["<answer>1</answer>", "1"], ["1", "1"], pattern=["<answer>", "<answer>"]) == [2.0, 0.0]
    with pytest.raises(ValueError, match=r"components\[0\] must be a mapping with name and weight"):
        get_reward("weighted", components=[{"name": "format"}])(["x"], ["y"])
    with pytest.raises(ValueError, match=r"components\[0\] has unknown key\(s\) weigth"):
        get_reward("weighted", components=[{"name": "format", "weight": 1, "weigth": 2}])(["x"], ["y"])
    with pytest.raises(ValueError, match="unknown reward 'boxed'"):
        get_reward("weighted", components=[{"name": "boxed", "weight": 1}])(["x"], ["y"])
