"""`mmrl.errors.one_line`: an exception's first line, typed or not, blank and long messages;
and the messages of the call sites built on it (probe evidence, reward errors, the
compiled rollout's fallback reason, an unreadable image)."""

import io

import pytest

from mmrl.errors import one_line


def test_the_first_line_of_a_multi_line_message_stripped():
    error = RuntimeError("\n  Error(s) in loading state_dict:\n\tMissing key(s): 'a'\n")
    assert one_line(error) == "Error(s) in loading state_dict:"
    assert one_line("  first\nsecond") == "first"


def test_a_blank_message_reads_as_the_type_name_or_the_given_text():
    assert one_line(KeyboardInterrupt()) == "KeyboardInterrupt"
    assert one_line(ValueError(" \n ")) == "ValueError"
    assert one_line(ValueError(), empty="(no message)") == "(no message)"
    assert one_line(ValueError(), empty="") == ""
    assert one_line("") == ""


def test_typed_puts_the_type_name_first_without_a_dangling_colon():
    assert one_line(ValueError("bad row\nmore"), typed=True) == "ValueError: bad row"
    assert one_line(ValueError(), typed=True) == "ValueError"
    assert one_line(ValueError("expected one of:\n a\n b"), typed=True) == "ValueError: expected one of"
    assert one_line(ValueError("padded  \nnext"), typed=True) == "ValueError: padded"
    assert one_line("a text", typed=True) == "a text"


def test_limit_cuts_longer_lines_with_an_ellipsis():
    assert one_line(ValueError("x" * 10), 10) == "x" * 10
    cut = one_line(ValueError("x" * 400 + "\nmore"), 300, typed=True)
    assert len(cut) == 300 and cut.startswith("ValueError: xxx") and cut.endswith("x...")


def test_probe_evidence_is_typed_unless_the_probe_wrote_the_sentence():
    from mmrl.probes.base import CheckFailed, one_line as probe_line

    assert probe_line(CheckFailed("logits differ by 0.3\ndetails")) == "logits differ by 0.3"
    assert probe_line(CheckFailed()) == ""
    assert probe_line(AssertionError()) == "AssertionError"
    assert probe_line(ImportError("install it:  \nwith pip")) == "ImportError: install it"
    assert len(probe_line(RuntimeError("y" * 500))) == 300 and probe_line(RuntimeError("y" * 500)).endswith("...")
    assert probe_line(RuntimeError("y" * 500), 50) == "RuntimeError: " + "y" * 33 + "..."


def _raises_two_lines(completions, answers, **fields):
    raise ValueError("no answer found\nin the completion")


def _raises_blank(completions, answers, **fields):
    raise ValueError()


def _returns_words(completions, answers, **fields):
    return ["high"] * len(completions)


def test_reward_errors_quote_the_first_line_or_say_there_was_none():
    from mmrl.rewards import RewardError, score

    with pytest.raises(RewardError) as raised:
        score(_raises_two_lines, ["a"], ["1"])
    assert str(raised.value).startswith("reward '_raises_two_lines' raised ValueError: no answer found")
    assert "\n" not in str(raised.value)
    with pytest.raises(RewardError, match=r"raised ValueError: \(no message\)"):
        score(_raises_blank, ["a"], ["1"])
    with pytest.raises(RewardError, match=r"^reward '_returns_words' returned something other than numbers "
                                          r"\(could not convert string to float: 'high'\)$"):
        score(_returns_words, ["a"], ["1"])


def test_the_compiled_rollout_names_why_it_fell_back(monkeypatch):
    from mmrl.rollout.compiled import CompiledHFRollout
    from mmrl.rollout.hf import HFRollout

    def fails(*args):
        raise RuntimeError(message)

    monkeypatch.setattr(HFRollout, "_sample", lambda self, *args: "plain")
    for message, reason in [("graph break in step\n  at line 3", "RuntimeError: graph break in step"),
                            ("z" * 400, ("RuntimeError: " + "z" * 400)[:300])]:
        rollout = object.__new__(CompiledHFRollout)
        rollout.fallback_reason, rollout.caches, rollout._fast_sample = None, {}, fails
        with pytest.warns(UserWarning, match=r"hf_compiled: using plain generate \(RuntimeError: "):
            assert rollout._sample(None, None, None) == "plain"
        assert rollout.fallback_reason == reason


def test_an_unreadable_image_names_pillows_first_line():
    from PIL import Image

    from mmrl.data.schema import decode_image

    with pytest.raises(ValueError, match=r"^image bytes: not a readable image \(not an image format Pillow knows"):
        decode_image(b"not an image at all")
    png = io.BytesIO()
    Image.new("RGB", (64, 64)).save(png, "PNG")
    with pytest.raises(ValueError, match=r"^image bytes: not a readable image \(image file is truncated\)$"):
        decode_image(png.getvalue()[:60])


def test_whole_joins_every_line_of_the_message_into_one():
    error = ValueError("1 validation error for Recipe\n  trainer.steps\n    must be positive  ")
    assert one_line(error, typed=True, whole=True) == \
        "ValueError: 1 validation error for Recipe trainer.steps must be positive"
    assert one_line(error, 40, typed=True, whole=True) == "ValueError: 1 validation error for Re..."
    assert one_line(KeyError(), typed=True, whole=True) == "KeyError"
    assert one_line(" a\n\tb ", whole=True) == "a b"
