"""Reward functions: each built-in on right and wrong answers, lookup by name or path, combine."""

import importlib.util
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from mmrl.rewards import BUILTIN_REWARDS, combine, get_reward
from mmrl.rewards.builtin import last_number, parse_count


def my_reward(completions, answers, *, bonus=0.0, **fields):
    """A user reward found by its dotted path: the completion's length plus a bonus."""
    return [len(c) + bonus for c in completions]


def test_builtin_names():
    assert set(BUILTIN_REWARDS) == {"exact_match", "numeric", "math", "format", "counting", "boxed_math",
                                    "think_format", "weighted", "judge"}


def test_exact_match_normalizes_whitespace_and_case():
    reward = get_reward("exact_match")
    assert reward(["  Paris ", "New\n  York", "Lyon"], ["paris", "new york", "Paris"]) == [1.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "text, number",
    [("the answer is 42.", 42.0), ("-3.5 then 7", 7.0), ("1,234 apples", 1234.0), ("3/4", 0.75),
     ("1e3", 1000.0), ("#### 72", 72.0), ("no digits", None)],
)
def test_last_number(text, number):
    assert last_number(text) == number


def test_numeric_compares_the_last_number_with_tolerance():
    reward = get_reward("numeric")
    completions = ["2 + 3 = 5", "so x = 0.1 + 0.2 = 0.30000000000000004", "I think 6", "no idea"]
    assert reward(completions, ["5", "0.3", "5", "5"]) == [1.0, 1.0, 0.0, 0.0]
    assert get_reward("numeric", tolerance=0.5)(["about 5.4"], ["5"]) == [1.0]


def test_math_reward_falls_back_to_numeric_without_math_verify(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes the import fail
    reward = get_reward("math")
    assert reward(["The answer is \\boxed{12}", "so it is 1/2", "it is 13"], ["12", "0.5", "12"]) == [1.0, 1.0, 0.0]


needs_math_verify = pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="needs math_verify")


@needs_math_verify
@pytest.mark.slow
def test_math_reward_symbolic_with_math_verify():
    reward = get_reward("math")
    completions = ["\\boxed{\\frac{2}{4}}", "so $\\sqrt{2}$", "it is $1 + x^2$", "x = 3"]
    answers = ["0.5", "\\sqrt{2}", "$x^2+1$", "\\sqrt{2}"]
    assert reward(completions, answers) == [1.0, 1.0, 1.0, 0.0]


@needs_math_verify
def test_math_reward_works_outside_the_main_thread():
    # math_verify's SIGALRM timeout refuses to run in threads; the reward must not turn that into 0.0.
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(get_reward("math"), ["\\boxed{\\frac{1}{2}}"], ["0.5"]).result() == [1.0]


def test_format_default_option_and_per_row_field():
    reward = get_reward("format")
    assert reward(["<think>hm</think><answer>3</answer>", "3"], ["3", "3"]) == [1.0, 0.0]
    strict = get_reward("format", pattern=r"^<answer>\d+</answer>$")
    assert strict(["<answer>3</answer>", "<answer>3</answer> extra"], ["3", "3"]) == [1.0, 0.0]
    # A dataset column of per-row patterns arrives as a field.
    assert reward(["yes", "no"], ["", ""], pattern=["^yes$", "^yes$"]) == [1.0, 0.0]


@pytest.mark.parametrize(
    "text, count",
    [("3", 3), ("Three.", 3), ("There are 2 cats and three dogs", 3), ("<answer>seven</answer> (I saw 8)", 7),
     ("none", None), ("12", 12)],
)
def test_parse_count(text, count):
    assert parse_count(text) == count


def test_counting_full_partial_and_zero():
    reward = get_reward("counting")
    completions = ["3", "three", "<answer>4</answer>", "zero", "15", "many", "There are 3."]
    answers = ["3", "3", "3", "3", "3", "3", "three"]
    assert reward(completions, answers) == [1.0, 1.0, 0.2, 0.2, 0.0, 0.0, 1.0]
    assert get_reward("counting", partial=0.5)(["4"], ["3"]) == [0.5]


def test_dotted_path_lookup_both_spellings():
    for spec in ("test_rewards:my_reward", "test_rewards.my_reward"):
        assert get_reward(spec)(["ab", "abc"], ["", ""]) == [2.0, 3.0]
    bound = get_reward("test_rewards:my_reward", bonus=1.0)
    assert bound(["ab"], [""]) == [3.0]
    assert bound.__name__ == "my_reward"


def test_unknown_specs_fail_with_clear_messages():
    with pytest.raises(ValueError, match="unknown reward 'exact'.*counting, exact_match"):
        get_reward("exact")
    with pytest.raises(ValueError, match="reward 'no_such_module:fn': cannot import module 'no_such_module'"):
        get_reward("no_such_module:fn")
    missing = "reward 'test_rewards:missing': module 'test_rewards' has no function 'missing'"
    with pytest.raises(ValueError, match=missing):
        get_reward("test_rewards:missing")
    with pytest.raises(ValueError, match="reward 'counting' has no option partal"):
        get_reward("counting", partal=0.2)


def test_combine_weights_and_passes_fields():
    reward = combine([("exact_match", 1.0), (get_reward("format", pattern="^a"), 0.5), (my_reward, 0.1)])
    # "a": exact 1 + format 0.5 + length 0.1; "b": exact 0 + format 0 + length 0.1
    assert reward(["a", "b"], ["a", "a"], unused_column=[1, 2]) == pytest.approx([1.6, 0.1])
    assert len(reward.components) == 3
    bad = combine([(lambda completions, answers, **fields: [1.0], 1.0)])
    with pytest.raises(ValueError, match="returned 1 scores for 2 completions"):
        bad(["a", "b"], ["a", "b"])
