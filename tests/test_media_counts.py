"""Measured media token counts (mmrl.rollout.media_counts), for processors that do not count.

vLLM's Transformers backend asks a processor how many tokens an image of a given size
becomes; the measured counts must say what the processors that do count say.
"""

from collections import Counter

import pytest
from PIL import Image

from mmrl.registry import families, get_adapter
from mmrl.rollout.media_counts import COUNTS_METHOD, give_measured_counts, measured_counts

SIZES = [[40, 60], [224, 224], [300, 120]]  # (height, width): small, square, tall


# The zoo's vision-language families, by name: each test builds its processor (not collection).
ZOO_VLMS = [family.family for family in families() if get_adapter(family.family).is_multimodal]


@pytest.mark.parametrize("family", ZOO_VLMS)
def test_measured_counts_say_what_the_processor_s_own_counts_say(family):
    processor = get_adapter(family).tiny().processor
    measured = measured_counts(processor, image_sizes=SIZES)
    if not hasattr(type(processor), COUNTS_METHOD):
        # No counts of its own to hold them against: the rows are still the processor's.
        for size, rows in zip(SIZES, measured["num_image_patches"]):
            out = processor(text=[processor.image_token], images=[Image.new("RGB", size[::-1])], return_tensors="pt")
            assert rows in out["pixel_values"].shape[:2]
        return
    own = processor._get_num_multimodal_tokens(image_sizes=SIZES)
    assert measured["num_image_patches"] == list(own["num_image_patches"])
    for size, tokens, own_tokens in zip(SIZES, measured["num_image_tokens"], own["num_image_tokens"]):
        # A processor counts either every token its placeholder becomes (as measured) or
        # only the ones holding embeddings: the token the replacement repeats.
        out = processor(text=[processor.image_token], images=[Image.new("RGB", size[::-1])],
                        return_text_replacement_offsets=True)
        [replaced] = out["text_replacement_offsets"][0]
        ids = processor.tokenizer(replaced["replacement"], add_special_tokens=False)["input_ids"]
        embeddings = Counter(ids).most_common(1)[0][1]
        assert own_tokens in (tokens, embeddings), (size, tokens, embeddings, own_tokens)
        assert tokens >= embeddings


def test_each_size_is_measured_once_per_processor():
    processor = get_adapter("qwen2_vl").tiny().processor
    calls = []
    original = type(processor).__call__

    class Counting(type(processor)):
        def __call__(self, *args, **kwargs):
            calls.append(1)
            return original(self, *args, **kwargs)

    processor.__class__ = Counting
    first = measured_counts(processor, image_sizes=SIZES)
    again = measured_counts(processor, image_sizes=SIZES[::-1])
    assert len(calls) == len(SIZES)
    assert again["num_image_tokens"] == first["num_image_tokens"][::-1]


def test_only_a_class_without_counts_gets_the_measured_ones():
    counting = type(get_adapter("qwen2_vl").tiny().processor)
    own = getattr(counting, COUNTS_METHOD)
    assert not give_measured_counts(counting)
    assert getattr(counting, COUNTS_METHOD) is own
    silent = type("Silent", (object,), {})
    assert give_measured_counts(silent)
    assert getattr(silent, COUNTS_METHOD) is measured_counts
    assert not give_measured_counts(silent)


def test_a_processor_without_replacement_offsets_is_named_in_one_line():
    processor = get_adapter("qwen2_vl").tiny().processor
    original = type(processor).__call__

    class Plain(type(processor)):  # as a processor whose own __call__ never reaches them
        def __call__(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            out.pop("text_replacement_offsets", None)
            return out

    processor.__class__ = Plain
    with pytest.raises(ValueError, match="Plain reports 0 replaced image placeholders .* cannot place its images"):
        measured_counts(processor, image_sizes=SIZES[:1])


def test_a_clip_that_cannot_be_counted_says_so_as_vllm_expects():
    """vLLM serves a model without video when the count raises AttributeError."""
    processor = get_adapter("llava_onevision").tiny().processor
    with pytest.raises(AttributeError, match="cannot process a blank clip"):
        measured_counts(processor, video_sizes=[[4, 0, 0]])
    clips = measured_counts(processor, video_sizes=[[4, 64, 64]])
    assert clips["num_video_tokens"][0] > 0
