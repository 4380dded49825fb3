"""mmrl/rollout/text_suffix.py: a later turn's ids put together from the last prompt's and
the new text alone are the whole text's, on a byte-level BPE trained here (merges across
newlines, spaces and digits, as real vocabularies have) whatever the sampled turn holds;
cuts are only made at special tokens that strip nothing. The session's use of it (checked
once per rollout, exact against plain `generate`) is in tests/test_multi_turn_compiled.py."""

import pytest

from mmrl.rollout.text_suffix import CutPoints, anchor, continued

SPECIALS = ["<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def processing():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ["assistant\n12 34\n\n", "user\nhow many?\n", "\n\n\n 1 2 3 4 \n", "zoom() 4\n assistant"] * 50
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe)

    class TextProcessing:  # what `continued` reads of a `Processing`: the tokenizer and `process_texts`
        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

        def process_texts(self, texts, media):
            return dict(self.tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False))

    tokenizer.pad_token = "<|im_end|>"
    return TextProcessing(tokenizer)


def _render(turns):
    text = ""
    for role, content in turns:
        text += f"<|im_start|>{role}\n{content}<|im_end|>\n"
    return text + "<|im_start|>assistant\n"


def _ids(processing, text):
    return processing.tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("content", ["1 2 3", "\n\n4", " ", "4\n", "\n", "assistant\n\n", "zoom() 12 34 \n\n"])
def test_pieces_are_the_whole_texts_ids_whatever_the_turn_holds(processing, content):
    cuts = CutPoints(processing.tokenizer)
    first = _render([("user", "how many?")])
    prompt = _ids(processing, first)
    # What the policy wrote, as tokens: where the whole text merges them with the prompt's
    # last ones ("\n" + "\n\n4"), the ids below do not begin with these (the prefix rule
    # the session checks: the agent's drift), but they are still the whole text's.
    sampled = _ids(processing, content)
    second = _render([("user", "how many?"), ("assistant", content), ("user", "\n\n 1 2\n")])
    held = anchor(processing, cuts, first, prompt, {})
    assert held is not None and held.text == first and first[held.split:] == "assistant\n"
    rows = continued(processing, cuts, [held], [prompt + sampled], [second], [([], [])], [()])
    assert rows[0]["input_ids"] == _ids(processing, second)


def test_no_piece_where_the_template_rewrites_the_last_prompt_or_nothing_can_be_cut(processing):
    cuts = CutPoints(processing.tokenizer)
    first = _render([("user", "how many?")])
    held = anchor(processing, cuts, first, _ids(processing, first), {})
    rewritten = _render([("user", "how many? 4"), ("assistant", "4"), ("user", "1")])
    assert continued(processing, cuts, [held], [_ids(processing, first)], [rewritten], [([], [])], [()]) is None
    assert continued(processing, cuts, [held], [_ids(processing, first)], [first + "4 and no end"],
                     [([], [])], [()]) is None


def test_tokens_that_strip_whitespace_are_no_cut_points():
    from tokenizers import AddedToken, Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1},
                                                                                  unk_token="<unk>")))
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken("<strip>", lstrip=True, special=True,
                                                                           normalized=False),
                                                                AddedToken("<end>", special=True, normalized=False)]})
    cuts = CutPoints(tokenizer)
    assert cuts.first_start("a <strip> a <end>") is None  # the first special token strips: no cut
    assert cuts.first_start("a a <end> a") == 4 and cuts.last_end("a <end> a") == 7
    assert cuts.last_end("a <end> a <strip>") is None
