"""The special tokens of a processor, and the text placeholder that stands for an image
or a video in a prompt.

Decides which special tokens the tiny tokenizer holds (the processor's `*_token`
arguments, the tokenizer attributes its code reads, the tokens it fixes in its own code),
which named token a config's `*_token_id` field stem names (also where the processor
spells the frame word differently), and the placeholder: the first special token that,
put in a prompt beside one image (or video), the processor expands; for a processor that
expands none, no placeholder (cross-attention) or the image token written once per
feature the tiny model makes.
"""

from __future__ import annotations

import inspect
import re

from mmrl.errors import whole_cause
from mmrl.scaffold.base import ScaffoldError
from mmrl.scaffold.media_plan import MediaPlan, init_parameters, runs_with_image
from mmrl.scaffold.shrink import build_tiny


def tokens_in_source(processor_cls) -> tuple[dict[str, str], list[str], dict[str, str]]:
    """(named tokens, literal special tokens, optional tokens) the processor's code and
    defaults use. Optional tokens are tokenizer attributes the processor only reads when
    the tokenizer has them (`hasattr(tokenizer, "image_token")`), making its own token
    otherwise: the tiny tokenizer leaves them unset, as released tokenizers do, and holds
    the processor's own token as a plain special token."""
    from transformers import TokenizersBackend

    named: dict[str, str] = {}
    for name, parameter in init_parameters(processor_cls).items():
        if name.endswith("_token") and isinstance(parameter.default, str):
            named[name] = parameter.default
    literals: list[str] = []
    try:
        source = inspect.getsource(inspect.getmodule(processor_cls))
    except (OSError, TypeError):
        source = ""
    optional: dict[str, str] = {}
    for attribute in re.findall(r"""hasattr\(\s*(?:self\.)?tokenizer\s*,\s*["'](\w+_token)["']\s*\)""", source):
        if attribute in named:
            continue
        own = re.search(rf"""self\.{attribute}\s*=\s*AddedToken\(\s*["']([^"']+)["']""", source)
        optional[attribute] = own.group(1) if own else (_class_default(processor_cls, attribute)
                                                        or f"<{attribute.removesuffix('_token')}>")
    # Tokens the processor fixes in its own code (`self.image_token = "<|IMAGE_PAD|>"`).
    for attribute, literal in re.findall(r"""self\.(\w+_token)\s*=\s*["'](<[^"'\s]{1,40}>)["']""", source):
        if attribute not in named and attribute not in optional:
            named[attribute] = literal
    # Tokens the processor class holds as constants (`IMAGE_TOKEN = "]<]image[>["`, read as
    # `self.image_token = self.IMAGE_TOKEN`): named by the constant, lower-cased.
    for constant in dir(processor_cls):
        value = getattr(processor_cls, constant, None)
        if re.fullmatch(r"[A-Z][A-Z0-9_]*_TOKEN", constant) and isinstance(value, str) and value.strip():
            if constant.lower() not in named and constant.lower() not in optional:
                named[constant.lower()] = value
    for attribute in re.findall(r"tokenizer\.(\w+_token)\b", source):
        # Attributes every tokenizer has (bos_token, the add_bos_token switch) are not new tokens.
        if attribute not in named and attribute not in optional and not hasattr(TokenizersBackend, attribute) and (
                attribute not in ("pad_token", "eos_token", "bos_token", "unk_token")):
            default = _class_default(processor_cls, attribute)
            named[attribute] = default or f"<|{attribute.removesuffix('_token')}|>"
    # A processor token that is a tokenizer token under another name
    # (`self.image_token = tokenizer.context_image_token`) is that token, unless the
    # processor also reads the tokenizer's own attribute of that name (then the two differ).
    for attribute, target in re.findall(r"self\.(\w+_token)\s*=\s*(?:self\.)?tokenizer\.(\w+_token)\b", source):
        if attribute != target and target in named and not re.search(rf"tokenizer\.{attribute}\b", source):
            named[attribute] = named[target]
    for literal in re.findall(r"""["'](<[^<>"'\s{}]{1,40}>)["']""", source):
        if literal not in literals and literal not in named.values():
            literals.append(literal)
    return named, literals, optional


def _class_default(cls, attribute: str) -> str | None:
    value = getattr(cls, attribute, None)
    return value if isinstance(value, str) else None


# The words token names use for the two ends of a frame.
_FRAME_WORDS = {"start": "end", "begin": "end", "bos": "eos"}


def named_token(stem: str, named: dict[str, str]) -> str | None:
    """The named token for a config field's stem (`vision_start` for
    `vision_start_token_id`), also where the processor spells the frame word differently
    (`vision_bos_token`)."""
    head, _, word = stem.rpartition("_")
    ends = tuple(dict.fromkeys(_FRAME_WORDS.values()))
    twins = next((g for g in (tuple(_FRAME_WORDS), ends) if word in g), ()) if head else ()
    for spelling in dict.fromkeys([stem, *(f"{head}_{w}" for w in twins)]):
        token = named.get(f"{spelling}_token") or named.get(spelling)
        if token:
            return token
    return None


def _frames(named: dict[str, str]) -> list[tuple[str, str]]:
    """(start, end) token pairs among the named tokens: `vision_start` / `vision_end`,
    `image_begin` / `image_end`, `vision_bos` / `vision_eos` (names that differ only in
    the frame word)."""
    from mmrl.processors.templates import CHATML_SPECIAL_TOKENS

    pairs = []
    for name, start in named.items():
        for word, end_word in _FRAME_WORDS.items():
            if word in name:
                end = named.get(name.replace(word, end_word))
                # The chat template's message markers frame messages, not media.
                if end is not None and end != start and not {start, end} & set(CHATML_SPECIAL_TOKENS):
                    pairs.append((start, end))
    return pairs


def _in_config_frame(token: str, plan: MediaPlan, tokenizer, counted, kind: str) -> str:
    """`token` inside the start/end pair the config names by its token id fields
    (`vision_start_token_id` / `vision_end_token_id`) where the processor does not name it
    itself, as released chat templates write it around each image; else `token`. Two
    images in a row are then two runs of their tokens: a model that tells media apart
    by runs (transformers' `get_rope_index`, one grid a run) would otherwise read two
    adjacent images as one. A clip takes the pair named for videos first
    (`video_start_token_id`), as released templates frame a clip apart from an image."""
    by_field = {key.removesuffix("_id"): value for key, value in plan.token_fields.items()}
    frames = _frames(by_field)
    if kind == "video":
        own = set(_frames({k: v for k, v in by_field.items() if k.startswith(kind)}))
        frames = sorted(frames, key=lambda frame: frame not in own)
    for start, end in frames:
        if token in (start, end) or tokenizer.convert_tokens_to_ids(start) == tokenizer.unk_token_id:
            continue
        try:
            counts = counted(f"{start}{token}{end}")
        except Exception:  # noqa: BLE001 - the frame is optional: the bare token stands
            continue
        if counts.get(start) == 1 and counts.get(end) == 1:  # the processor does not frame it too
            return f"{start}{token}{end}"
    return token


# transformers' media token types (`mm_token_type_ids`): 0 text, 1 image, 2 video.
_VIDEO_TYPE = 2


def _processing(processor, text_kwargs=None):
    """mmrl's processing over `processor`, passing the tokenizer-side arguments the
    scaffolded family's processing will (`return_mm_token_type_ids`)."""
    from mmrl.processing import Processing

    class Scaffolded(Processing):
        def text_kwargs(self):
            return dict(text_kwargs or {})

    return Scaffolded(processor)


def _literal_frames(literals: list[str], kind: str) -> list[tuple[str, str]]:
    """(start, end) pairs among the special tokens a processor's code spells out that
    name the kind (`<|begin_of_video|>` / `<|end_of_video|>`): some processors find a
    clip's tokens by such a pair, not by any token the config or tokenizer names."""
    return [(start, start.replace(word, end)) for start in literals if kind in start
            for word, end in _FRAME_WORDS.items() if word in start and start.replace(word, end) in literals]


def find_placeholder(processor, tokenizer, plan: MediaPlan, kind: str) -> str | None:
    """The text that, written in a prompt beside one image (or video), the processor
    expands: the processor's own `*_token` for the kind inside a start/end frame the
    processor does not add itself (so that two media in a row stay two runs), else that
    token alone, then every other named token. The token it expands into most often is
    the one the model counts, so the config's id field for the kind is pointed at it.

    A clip is processed as a run processes one (`mmrl.processing`: its frames sampled
    already, their metadata passed), its placeholder tried first inside a video frame
    pair the processor's code spells out (`<|begin_of_video|>`), and kept only where the
    processor types its tokens as video for a model that reads `mm_token_type_ids`."""
    from PIL import Image

    field = next((k for k in plan.token_fields if k.startswith(kind)), None)
    own = [t for name, t in plan.named_tokens.items() if name.startswith(kind)]
    specials = list(dict.fromkeys(list(plan.named_tokens.values()) + plan.literals))
    frames = _frames(plan.named_tokens)
    framed = [f"{a}{t}{b}" for t in own for a, b in frames if t not in (a, b)]
    clip_frames = _literal_frames(plan.literals, kind) if kind == "video" else []
    frames += clip_frames
    framed += [f"{a}{t}{b}" for t in specials for a, b in clip_frames if t not in (a, b)]
    candidates = list(dict.fromkeys(framed + own + specials))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in specials}
    image = Image.new("RGB", (224, 168), (120, 30, 200))
    errors: list[str] = []

    def counted(token: str) -> dict[str, int]:
        text = [f"look {token} here"]
        if kind == "image":
            row = processor(text=text, return_tensors="pt", images=[image])["input_ids"][0]
        else:  # as a run processes a clip: its frames already sampled, their metadata passed
            batch = processing.process_texts(text, [([], [clip])])
            types = batch.get("mm_token_type_ids") if plan.text_kwargs.get("return_mm_token_type_ids") else None
            if types is not None and not (types == _VIDEO_TYPE).any():
                raise ValueError("the processor types none of the clip's tokens as video (mm_token_type_ids), "
                                 "so the model would place no clip")
            row = batch["input_ids"][0]
        return {t: row.tolist().count(i) for t, i in ids.items()}

    if kind == "video":
        processing = _processing(processor, plan.text_kwargs)
        clip = processing.load_video([image] * 4)

    single = None
    try:  # what the processor inserts on its own, with no placeholder in the text
        alone = counted("")
    except Exception:
        alone = None
    for token in candidates:
        try:
            counts = counted(token)
        except Exception as exc:
            errors.append(f"{token}: {whole_cause(exc, 120)}")
            continue
        if token in framed and any(counts.get(f) != 1 for frame in frames for f in frame if f in token):
            continue  # the processor frames media itself: a frame in the text would double it
        expanded = max(counts, key=lambda t: counts[t])
        if alone is not None and counts[expanded] == alone[expanded] + (expanded == token):
            continue  # passed through unexpanded beside what the processor inserts itself
        if counts[expanded] > 1 or counts[expanded] == 1 and expanded not in token:
            if field is not None:
                plan.token_fields[field] = expanded
            for start, end in clip_frames:
                if token.startswith(start) and token.endswith(end):
                    # The pair the processor frames a clip with is the one the config names:
                    # a model that finds a clip's span by the config's ids then finds it.
                    for key, frame in ((f"{kind}_start_token_id", start), (f"{kind}_end_token_id", end)):
                        if key in plan.token_fields:
                            plan.token_fields[key] = frame
            return token if token in framed else _in_config_frame(token, plan, tokenizer, counted, kind)
        if alone is None and counts.get(token) == 1 and single is None:
            single = token  # required once per image and kept as one token (cross-attention models)
    if single is not None:
        if field is not None:
            plan.token_fields[field] = single
        return single
    if alone is not None and max(alone.values(), default=0) > 1:
        # The processor places the media tokens itself (before the text): no placeholder.
        if field is not None:
            plan.token_fields[field] = max(alone, key=lambda t: alone[t])
        return ""
    if kind == "image":
        raise ScaffoldError(f"no special token ({', '.join(candidates[:6])}) is expanded by {plan.processor_class} "
                            "beside an image" + (f" (first error: {errors[0]})" if errors else "")
                            + "; write the chat template by hand", category="processor")
    return None


def unexpanded_placeholder(model_class: str, config, processor, plan: MediaPlan) -> str | None:
    """The image placeholder for a processor that expands no token (the released chat
    template writes them out): none, where the model reads the image by cross-attention
    and runs without one; else the kind's own token written once per image feature the
    tiny model makes, where that runs. None when neither does."""
    import torch
    from PIL import Image

    if runs_with_image(model_class, config, processor, "") is None:
        return ""
    own = [t for name, t in plan.named_tokens.items() if name.startswith("image")]
    if not own:
        return None
    try:  # how many features the tiny model makes of one image, at two sizes
        model = build_tiny(model_class, config)
        accepted = inspect.signature(model.get_image_features).parameters
        counts = set()
        for size in ((224, 168), (56, 56)):
            inputs = processor(text=["look here"], images=[Image.new("RGB", size, (9, 99, 199))], return_tensors="pt")
            media = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items() if k in accepted}
            with torch.no_grad():
                features = model.get_image_features(**media)
            features = getattr(features, "pooler_output", features)
            features = torch.cat(list(features)) if isinstance(features, (list, tuple)) else features
            counts.add(features.numel() // features.shape[-1])
    except Exception:
        return None
    if len(counts) != 1:  # the count follows the image size: no fixed template can spell it
        return None
    count = counts.pop()
    # The token the config's id field already names (the config was built with it).
    field = next((k for k in plan.token_fields if k.startswith("image")), None)
    token = plan.token_fields[field] if field is not None else own[0]
    if count > 0 and runs_with_image(model_class, config, processor, token * count) is None:
        return token * count
    return None
