"""Idefics3 and SmolVLM input processing, and their tiny offline processors.

Both families split an image into square tiles of the vision encoder's size plus one
downscaled global tile; each tile becomes `image_seq_len` `<image>` tokens wrapped in
`<fake_token_around_image>` and a `<row_i_col_j>` / `<global-img>` tag. They differ only
in the chat template's first token, the tokenizer attribute names the processor reads,
and SmolVLM's video processor, so one module serves both (`IDEFICS3`, `SMOLVLM`).
"""

from __future__ import annotations

import copy
import math
import re
import warnings
from dataclasses import dataclass
from typing import Any

from mmrl.processing import Processing, media_kinds, stack_media
from mmrl.tiny import as_loaded, char_tokenizer, tiny_text_config

FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
VIDEO_TOKEN = "<video>"
# The processors address tiles as <row_i_col_j> for a grid of up to 6 x 6.
ROW_COL_TOKENS = tuple(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))


def chat_template(bos: str) -> str:
    """The Idefics3/SmolVLM template: `User:<image>text<end_of_utterance>\\nAssistant:`.
    A role whose content opens with an image gets no space after the colon."""
    return (
        bos
        + "{% for message in messages %}"
        "{{ message['role'] | capitalize }}"
        "{% if message['content'] is not string and message['content'][0]['type'] in ('image', 'video') %}{{ ':' }}"
        "{% else %}{{ ': ' }}{% endif %}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}"
        "{% elif part['type'] == 'image' %}{{ '<image>' }}"
        "{% elif part['type'] == 'video' %}{{ '<video>' }}"
        "{% endif %}{% endfor %}{% endif %}"
        "{{ '<end_of_utterance>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
    )


@dataclass(frozen=True)
class Flavour:
    """What differs between the Idefics3 and SmolVLM stacks built on this module."""

    prefix: str  # HF class-name prefix: Idefics3Config, SmolVLMProcessor, ...
    bos_token: str
    video: bool


IDEFICS3 = Flavour(prefix="Idefics3", bos_token="<|begin_of_text|>", video=False)
SMOLVLM = Flavour(prefix="SmolVLM", bos_token="<|im_start|>", video=True)

# Tiny shapes: 56-pixel tiles of 14-pixel patches give a 4 x 4 grid, which the 2x pixel
# shuffle folds into 4 tokens per tile; images are rescaled to a longest edge of two
# tiles, so a test image is at most 2 x 2 tiles + the global tile = 20 image tokens.
TINY_TILE = 56
TINY_PATCH = 14
TINY_SCALE_FACTOR = 2
TINY_LONGEST_EDGE = 2 * TINY_TILE


def image_seq_len(tile: int, patch: int, scale_factor: int) -> int:
    """Tokens per tile, as both the processor and the model's connector count them."""
    return (tile // patch) ** 2 // scale_factor**2


def tiny_model(flavour: Flavour):
    """(config, processor) of a random-init Idefics3-style model for `flavour`."""
    import transformers

    named = {
        "image_token": IMAGE_TOKEN,
        "fake_image_token": FAKE_IMAGE_TOKEN,
        "global_image_token": GLOBAL_IMAGE_TOKEN,
        "end_of_utterance_token": END_OF_UTTERANCE,
    }
    if flavour.video:
        named["video_token"] = VIDEO_TOKEN
    tokenizer = char_tokenizer(
        special_tokens=ROW_COL_TOKENS,
        named_tokens=named,
        bos_token=flavour.bos_token,
        eos_token=END_OF_UTTERANCE,
        pad_token="<|end_of_text|>",
        chat_template=chat_template(flavour.bos_token),
    )
    sizes = {"size": {"longest_edge": TINY_LONGEST_EDGE}, "max_image_size": {"longest_edge": TINY_TILE}}
    parts = {
        "image_processor": as_loaded(getattr(transformers, f"{flavour.prefix}ImageProcessor")(
            do_image_splitting=True, **sizes
        )),
        "tokenizer": tokenizer,
    }
    if flavour.video:
        # Frames are never split: each one is resized to a single tile.
        parts["video_processor"] = getattr(transformers, f"{flavour.prefix}VideoProcessor")(**sizes)
    processor = getattr(transformers, f"{flavour.prefix}Processor")(
        **parts,
        image_seq_len=image_seq_len(TINY_TILE, TINY_PATCH, TINY_SCALE_FACTOR),
        chat_template=tokenizer.chat_template,
    )
    text = tiny_text_config("transformers:LlamaConfig", tokenizer, tie_word_embeddings=False)
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=TINY_TILE, patch_size=TINY_PATCH,
    )
    config = getattr(transformers, f"{flavour.prefix}Config")(
        text_config=text.to_dict(),
        vision_config=vision,
        scale_factor=TINY_SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return config, processor


class Idefics3Processing(Processing):
    """Pixel budget for tiling processors: `max_pixels` caps the longest edge images are
    rescaled to, in whole tiles, so an image costs at most (edge / tile)^2 + 1 tiles.

    Idefics3 rescales every image (small ones too) to that one longest edge, so the
    token count depends on `max_pixels` and the aspect ratio only; `min_pixels` has no
    separate setting and is ignored. A budget below one tile gives one unsplit tile.

    An assistant's text is written right after `Assistant:`, as the model wrote it. The
    checkpoints' template writes `Assistant: ` + text, while generation is prompted with
    `Assistant:` and the model samples the space itself (most often inside its first
    token); a sampled turn rendered back through that template gained a space it never
    sampled whenever it did not open with one, and the agent loop had to end the sample
    (the prefix rule, `mmrl.rollout.agent`). A hand-written assistant turn therefore
    opens with the space the model would write (" Yes."). An export saves the template
    rewritten to render this way (`trained_chat_template`), so served or re-rendered
    conversations are the token ids training saw.
    """

    def image_kwargs(self) -> dict[str, Any]:
        if self.max_pixels is None:
            return {}
        tile = self.processor.image_processor.max_image_size["longest_edge"]
        edge = max(1, math.isqrt(self.max_pixels) // tile) * tile
        return {"size": {"longest_edge": edge}}

    def processor_with_budget(self):
        """Also carries the template training rendered with (`trained_chat_template`), so an
        exported folder, served or rendered by plain transformers, writes an assistant turn
        as the model was trained on it (`Assistant:` + its text, no added space); warns
        where that template cannot be written."""
        processor = super().processor_with_budget()
        template = self.trained_chat_template()
        if template is None:
            warnings.warn("export: the chat template saved with the processor renders assistant turns with a space "
                          "after 'Assistant:' that training did not write, and mmrl could not rewrite it; served "
                          "conversations may differ from the trained token ids", stacklevel=2)
            return processor
        if template == getattr(processor, "chat_template", None):
            return processor
        if processor is self.processor:
            processor = copy.deepcopy(processor)
        processor.chat_template = template
        tokenizer = getattr(processor, "tokenizer", None)
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = template
        return processor

    def trained_chat_template(self) -> str | None:
        """A chat template that renders as `render` does: the processor's own where it
        already does, else that template with the separator after `Assistant:` dropped for
        an assistant turn of text alone; None where the template has no one `': '`
        separator to rewrite, or the rewrite does not render the check conversations
        exactly as `render` does."""
        template = getattr(self.processor, "chat_template", None) or getattr(self.tokenizer, "chat_template", None)
        if not isinstance(template, str):
            return None
        if self._renders_as_trained(template):
            return template
        if len(_SEPARATOR.findall(template)) != 1:
            return None
        rewritten = _SEPARATOR.sub(lambda found: _ASSISTANT_SEPARATOR.format(separator=found.group(0)), template)
        return rewritten if self._renders_as_trained(rewritten) else None

    def _renders_as_trained(self, template: str) -> bool:
        for conversation in _TEMPLATE_CHECKS:
            for prompt in (True, False):
                try:
                    exported = self.processor.apply_chat_template(
                        conversation, chat_template=template, tokenize=False, add_generation_prompt=prompt,
                        **self.template_kwargs())
                except Exception:  # noqa: BLE001 - a template this rewrite does not fit stays as it is
                    return False
                if exported != self.render(conversation, prompt):
                    return False
        return True

    def render(self, conversation, add_generation_prompt: bool = True) -> str:
        texts: dict[str, str] = {}
        marked = []
        for message in conversation:
            text = _text_only(message) if message.get("role") == "assistant" else None
            if text is None:
                marked.append(message)
                continue
            marker = f"{_MARKER}{len(texts)}{_MARKER}"
            texts[marker] = text
            marked.append({**message, "content": marker})
        rendered = super().render(marked, add_generation_prompt)
        for marker, text in texts.items():
            # The template's own separator before the text goes; the text keeps its own.
            rendered = rendered.replace(f" {marker}", marker, 1).replace(marker, text, 1)
        return rendered


# Stands in for an assistant's text while the template renders (no template writes it).
_MARKER = "\u2063MMRL-ASSISTANT\u2063"
# The template's separator after a role name (`{{': '}}` in the checkpoints' templates),
# and what the exported template writes instead: nothing after `Assistant:` for a turn of
# text alone, the separator otherwise (what `render` writes).
_SEPARATOR = re.compile(r"""\{\{-?\s*(['"]): \1\s*-?\}\}""")
_ASSISTANT_SEPARATOR = ("{{% if message['role'] == 'assistant' and (message['content'] is string or "
                        "message['content'] | rejectattr('type', 'equalto', 'text') | list | length == 0) %}}"
                        "{{{{ ':' }}}}{{% else %}}{separator}{{% endif %}}")
# Conversations on which the exported template must render as `render` does: assistant
# turns with and without the space the model may sample (content as parts: `render` passes
# the template parts, and the checkpoints' templates read `content[0]['type']`).
_TEMPLATE_CHECKS = (
    [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
     {"role": "assistant", "content": [{"type": "text", "text": "A dot."}]},
     {"role": "user", "content": [{"type": "text", "text": "Sure?"}]},
     {"role": "assistant", "content": [{"type": "text", "text": " Yes."}]}],
    [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
     {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
     {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]}],
)


def _text_only(message: dict) -> str | None:
    """A message's text when it holds text alone (a string or text parts), else None."""
    content = message.get("content", "")
    if isinstance(content, str):
        return content
    if all(part.get("type") == "text" for part in content):
        return "".join(part.get("text", "") for part in content)
    return None


class SmolVLMProcessing(Idefics3Processing):
    """SmolVLM also reads videos, nested one list per sample.

    Its processor writes image tiles and video frames to the same `pixel_values`, so in
    one call the videos' overwrite the images' (the text it expands is right). A batch
    that holds both kinds is therefore processed a prompt at a time and joined: ids
    padded on the padding side, tiles and frames padded with all-zero ones, which the
    model drops as it drops the processor's own padding. A prompt holding both gets its
    `pixel_values` from each image and video processed alone, in the order the prompt
    places them: the order in which the model fills the `<image>` placeholders of
    tiles and frames."""

    def arrange_videos(self, videos: list[list[Any]]) -> list[Any]:
        return videos

    def template_kwargs(self) -> dict[str, Any]:
        # Without processor_kwargs, SmolVLM's apply_chat_template puts its video defaults
        # in **kwargs, and transformers warns about that on every render. They only matter
        # when the template call also processes media, which rendering text does not.
        video = self.processor.video_processor
        return {"processor_kwargs": {"num_frames": video.num_frames, "fps": video.fps}}

    def __call__(self, conversations, add_generation_prompt: bool = True):
        kinds = [media_kinds(c) for c in conversations]
        if not (any("image" in k for k in kinds) and any("video" in k for k in kinds)):
            return super().__call__(conversations, add_generation_prompt)
        rows = [self._one_prompt(c, add_generation_prompt) for c in conversations]
        # A text-only prompt gets one all-zero tile, the processor's own padding.
        for key in {k for r in rows for k in r}:
            template = next(r[key] for r in rows if key in r)
            for r in rows:
                r.setdefault(key, template.new_zeros((1, 1, *template.shape[2:])))
        from transformers import BatchFeature

        return BatchFeature(data=self.collate(rows))

    def _one_prompt(self, conversation, add_generation_prompt: bool) -> dict:
        batch = dict(super().__call__([conversation], add_generation_prompt))
        if len(media_kinds(conversation)) < 2:
            return batch
        pieces = [dict(super(SmolVLMProcessing, self).__call__([[{"role": "user", "content": [part]}]]))
                  for message in conversation if not isinstance(message.get("content", ""), str)
                  for part in message["content"] if part.get("type") in ("image", "video")]
        for key in ("pixel_values", "pixel_attention_mask"):
            if key in batch:
                batch[key] = stack_media([p[key][0] for p in pieces]).unsqueeze(0)
        return batch
