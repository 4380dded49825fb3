"""Stage 7, render: the text of a scaffolded family's files (adapter, processing stub,
test) from what the earlier stages found. The adapter reads as a hand-written one:
declarations first, then `tiny()` with the shrunk values spelled out."""

from __future__ import annotations

import re
import textwrap
from dataclasses import replace
from typing import Any

from mmrl.adapter import ATTN_AND_MLP, DECODER_PARTS, VISION_TOWER_PARTS, Capabilities, Parts
from mmrl.scaffold.base import COLUMNS, VISION_ONLY, Discovery, Gap, Layout


def _str(value: str) -> str:
    """A string literal in the house's double quotes."""
    return f'"{value}"' if re.fullmatch(r"[^\"\\\n]*", value) else repr(value)


def _tuple(values) -> str:
    values = tuple(values)
    return "(" + ", ".join(_str(v) for v in values) + ("," if len(values) == 1 else "") + ")"


def _call(head: str, args: list[str], indent: str = "    ", width: int = 116) -> str:
    """`head(arg, ...)` on one line when it fits, else its arguments wrapped below."""
    line = f"{head}({', '.join(args)})"
    if len(indent) + len(line) <= width:
        return line
    rows, row = [], ""
    for arg in args:
        if row and len(indent) + 4 + len(row) + len(arg) + 2 > width:
            rows.append(row.rstrip())
            row = ""
        row += arg + ", "
    rows.append(row.rstrip())
    inner = "\n".join(indent + "    " + r for r in rows)
    return f"{head}(\n{inner}\n{indent})"


def _literal(value: Any) -> str:
    if type(value) is str:
        return _str(value)
    return _literal_dict(value) if type(value) is dict else repr(value)


def _literal_dict(values: dict[Any, Any]) -> str:
    return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in values.items()) + "}"


def _one_or_tuple(values: tuple[str, ...]) -> str:
    return _str(values[0]) if len(values) == 1 else _tuple(values)


def _parts_source(parts: Parts, imports: set[str]) -> str:
    if parts == DECODER_PARTS:
        imports.add("DECODER_PARTS")
        return "DECODER_PARTS"
    if parts == VISION_TOWER_PARTS:
        imports.add("VISION_TOWER_PARTS")
        return "VISION_TOWER_PARTS"
    if replace(parts, projector=VISION_TOWER_PARTS.projector) == VISION_TOWER_PARTS:
        imports.add("VISION_TOWER_PARTS")
        return f"replace(VISION_TOWER_PARTS, projector={_one_or_tuple(parts.projector)})"
    imports.add("Parts")
    fields = [f"{name}={_one_or_tuple(paths)}" for name, paths in parts.items() if paths]
    return "Parts(\n        " + ", ".join(fields) + ",\n    )"


def _leaves_source(leaves: tuple[str, ...], imports: set[str]) -> str:
    if sorted(leaves) == sorted(ATTN_AND_MLP):
        imports.add("ATTN_AND_MLP")
        return "ATTN_AND_MLP"
    return _tuple(leaves)


def _rope_line(rope) -> str:
    if rope.theta is None:
        return "no rotary position embedding"
    text = f"{rope.scaling} rope, theta {rope.theta:g}"
    if rope.partial_rotary_factor != 1.0:
        text += f", rotating {rope.partial_rotary_factor:g} of each head"
    if rope.per_layer_type:
        text += f", one rope per layer type ({', '.join(t for t, _ in rope.per_layer_type)})"
    if rope.is_mrope:
        text += f", mrope sections {list(rope.mrope_section)}"
    return text


def _capabilities_source(d: Discovery, verified: Capabilities | None, imports: set[str],
                         checked: bool = False, gaps: list[Gap] = ()) -> list[str]:
    if verified is None and checked:
        imports.add("Capabilities")
        return ["    # The tiny model did not run while scaffolding (see above), so nothing is declared;",
                f"    # once tiny() runs, `mmrl doctor {d.family}` says what to claim.",
                "    capabilities = Capabilities.none()"]
    if verified is None:
        return ["    # Capabilities: the defaults, not checked while scaffolding (--no-verify);",
                f"    # the zoo tests and `mmrl support-matrix --family {d.family}` verify them."]
    imports.add("Capabilities")
    defaults = Capabilities()
    claims = [f"{name}={getattr(verified, name)}" for name in COLUMNS
              if (getattr(verified, name) or getattr(defaults, name))
              and (d.resolved.is_vision_language or name not in VISION_ONLY)]
    lines = [
        "    # What `mmrl add-model` verified on the tiny model. fsdp2 and critic are claimed by default;",
        "    # where the scaffold ran with --no-depth (or --columns), video, sequence_parallel, multi_turn",
        f"    # and vllm are left out until `mmrl support-matrix --family {d.family}` verifies them.",
    ]
    for gap in gaps:
        lines += textwrap.wrap(f"Not declared: {gap.column} ({gap.cause}); to claim it, {gap.write}.", 92,
                               initial_indent="    # ", subsequent_indent="    #   ")
    return lines + ["    capabilities = " + _call("Capabilities", claims, width=116 - len("capabilities = "))]


def base_capabilities(d: Discovery) -> Capabilities:
    if d.resolved.is_vision_language:
        return Capabilities(single_image=True, multi_image=True)
    return Capabilities()


def render_adapter(d: Discovery, layout: Layout, verified: Capabilities | None,
                   processing_ref: str | None = None, checked: bool = False, gaps: list[Gap] = ()) -> str:
    """The adapter module's source: declarations first, then the tiny model."""
    vlm = d.resolved.is_vision_language
    base = "VisionLanguageAdapter" if vlm else "ModelAdapter"
    adapter_imports = {base, "Rollout", "TinyModel"}
    lines = ["@register_model", f"class {d.class_name}({base}):",
             f"    family = {_str(d.family)}",
             f"    model_types = {_tuple(_model_types(d))}",
             f"    hf_class = \"transformers:{d.resolved.model_class}\""]
    if vlm and verified is not None and verified.video:
        lines.append('    modalities = ("text", "image", "video")')
    lines.append(f"    parts = {_parts_source(d.parts, adapter_imports)}")
    shard = d.decoder_layers + ((d.vision_block,) if d.vision_block else ())
    lines.append(f"    shard_layers = {_tuple(shard)}")
    if vlm:
        adapter_imports.add("LoraTargets")
        language = _leaves_source(d.language_leaves, adapter_imports)
        lines.append("    lora = " + _call("LoraTargets", [f"language={language}", f"vision={_tuple(d.vision_leaves)}"]))
    elif sorted(d.language_leaves) != sorted(ATTN_AND_MLP):
        adapter_imports.add("LoraTargets")
        lines.append(f"    lora = LoraTargets(language={_tuple(d.language_leaves)})")
    lines += _capabilities_source(d, verified, adapter_imports, checked, gaps)
    if d.sequence_parallel is not None:
        adapter_imports.add("SequenceParallel")
        spec = d.sequence_parallel
        masked = "(" + ", ".join(f"({_str(m)}, {_tuple(rows)})" for m, rows in spec.masked_inputs) + \
            ("," if len(spec.masked_inputs) == 1 else "") + ")"
        if spec.gather_mixers:
            lines += ["    # Ulysses cannot split this decoder's sequence mixing by heads (its probe failed): each",
                      "    # mixing module runs on the gathered sequence, the rest on each rank's positions.",
                      "    sequence_parallel = SequenceParallel(gather_mixers=True)"]
        else:
            lines += ["    # The decoder gets these along the sequence too (found by running it): Ulysses cuts them.",
                      "    sequence_parallel = " + _call("SequenceParallel", [
                          f"split_inputs={_tuple(spec.split_inputs)}", f"masked_inputs={masked}"])]
    if processing_ref:
        lines.append(f"    processing = {_str(processing_ref)}")
    if d.prepends_positions:
        lines += ["    # The logits run longer than input_ids, image positions of the model's own in front",
                  "    # (found by running it): on_load cuts them to input_ids' positions.",
                  "    prepends_positions = True"]
    if d.encode_images_alone:
        lines += ["    # The tower lets a batch's images attend to each other (found by running it): the",
                  "    # encoder runs once per image, so an image's features do not change with its batch.",
                  "    encode_images_alone = True"]
    if not d.left_padding:
        lines += ["    # The forward ignores the mask for pads in front (a left-padded batch differed from",
                  "    # each prompt alone with counted and with its own positions; right-padded, it matched).",
                  "    left_padding = False"]
    lines.append(f"    # {d.vllm_note}.")
    if d.vllm_architecture:
        lines.append(f"    rollout = Rollout(vllm_architecture={_str(d.vllm_architecture)})")
    else:
        lines.append("    rollout = Rollout()")
    lines.append("")
    if d.redraw_zeros:
        lines += ["    def prepare_model(self, model):",
                  '        """The weights the class initializes to zero (a checkpoint replaces them), which',
                  '        cut every gradient to the vision tower of the random-init tiny model: drawn."""',
                  *_redraw_lines(d.redraw_zeros), ""]
    if d.nested_head:
        lines += ["    def on_load(self, model):",
                  '        """The class declares no output embeddings of its own: the causal LM it nests',
                  f'        (`{d.nested_head}`) makes the logits, and its head is the model\'s (mmrl\'s log-prob',
                  '        head reads the model\'s)."""',
                  "        model = super().on_load(model)",
                  f"        nested = model.get_submodule({_str(d.nested_head)})",
                  "        model.get_output_embeddings = nested.get_output_embeddings",
                  "        return model", ""]
    if d.own_positions:
        lines += ["    def position_ids(self, model, batch):",
                  '        """None: the model places its own positions (offset or masked by its code);',
                  '        a padded batch matched each prompt alone that way, not with counted ones."""',
                  "        return None", ""]
    if d.rope_index_per_row:
        lines += ["    def position_ids(self, model, batch):",
                  '        """The model\'s own rope index, one row at a time: over a whole batch its',
                  "        `get_rope_index` counts media across rows (a padded batch differed from each prompt",
                  '        alone); row by row, with each row\'s share of the per-media inputs, it matched."""',
                  "        return rope_index_per_row(model, batch)", ""]
    if d.rope_index_positions:
        lines += ["    def position_ids(self, model, batch):",
                  '        """The model\'s own rope index over the batch (what it computes when given none),',
                  '        written out: packed rows and shared media then keep each sequence\'s positions."""',
                  "        return rope_index_positions(model, batch)", ""]
    lines += _tiny_source(d)
    summary = (f'"""{d.class_name} ({"vision-language" if vlm else "text"}, transformers {d.resolved.model_class}): '
               f"scaffolded by `mmrl add-model {d.resolved.model_type}`.")
    layout_text = (f"Layout read off the tiny model: decoder layers {', '.join(d.decoder_layers)}"
                   + (f", vision blocks {d.vision_block}" if d.vision_block else "") + f"; {_rope_line(d.rope)}. "
                   "The tiny tokenizer speaks ChatML; a real checkpoint brings its own chat template.")
    header = [textwrap.fill(summary, 100), "", textwrap.fill(layout_text, 88)]
    if d.fill_in:
        header += ["", "Fill in by hand (the scaffold could not work these out):"]
        header += [textwrap.fill(item, 88, initial_indent="- ", subsequent_indent="  ") for item in d.fill_in]
    header.append('"""')
    imports = ["from dataclasses import replace", ""] if "replace(" in "\n".join(lines) else []
    names = sorted(adapter_imports, key=_import_order)
    line = "from mmrl.adapter import " + ", ".join(names)
    imports.append(line if len(line) <= 116 else _call("from mmrl.adapter import ", names, indent=""))
    positions = [name for name, used in (("rope_index_per_row", d.rope_index_per_row),
                                          ("rope_index_positions", d.rope_index_positions)) if used]
    if positions:
        imports.append(f"from mmrl.positions import {', '.join(positions)}")
    if vlm:
        imports.append("from mmrl.processors.templates import CHATML_SPECIAL_TOKENS, chatml_with_media")
        imports.append("from mmrl.registry import register_model")
        imports.append("from mmrl.tiny import " + ", ".join(
            ["as_loaded", "char_tokenizer", *(["redraw_zeros"] if d.redraw_zeros else []), "sized_config"]))
    else:
        imports.append("from mmrl.processors.templates import CHATML, CHATML_SPECIAL_TOKENS")
        imports.append("from mmrl.registry import register_model")
        imports.append("from mmrl.tiny import char_tokenizer, sized_config")
    body = "\n".join(header) + "\n\n" + "\n".join(imports) + "\n"
    if vlm:
        body += "\n" + _vision_template_source(d) + "\n"
    return body + "\n\n" + "\n".join(lines) + "\n"


def _redraw_lines(patterns: tuple[str, ...]) -> list[str]:
    line = "        return redraw_zeros(model, " + _tuple(patterns) + ")"
    if len(line) <= 116:
        return [line]
    return ["        return redraw_zeros(model, (", *(f"            {_str(p)}," for p in patterns), "        ))"]


def _model_types(d: Discovery) -> list[str]:
    """The type scaffolded, and the type its config class writes when that differs (a
    checkpoint's config.json then names the class's type)."""
    written = getattr(d.tiny.config, "model_type", None) if d.tiny is not None else None
    return list(dict.fromkeys([d.resolved.model_type, *([written] if written else [])]))


def _import_order(name: str) -> tuple[bool, str]:
    return (not name.isupper(), name)


def _tiny_source(d: Discovery) -> list[str]:
    tiny = d.tiny
    if d.resolved.is_vision_language:
        return _tiny_vision_source(d)
    call = _call("config = sized_config", [f'"transformers:{d.resolved.config_class}"', "tokenizer"]
                 + _keyword_args(tiny.text_overrides), " " * 4, 112)
    source = textwrap.dedent("""\
        def tiny(self) -> TinyModel:
            tokenizer = char_tokenizer(
                special_tokens=CHATML_SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                chat_template=CHATML,
            )
            # The default config, shrunk (what `mmrl add-model` found to shrink).
            @CONFIG@
            return TinyModel(config=config, processor=tokenizer)
        """).replace("@CONFIG@", call)
    return textwrap.indent(source, "    ").rstrip().split("\n")


def _keyword_args(values: dict[str, Any]) -> list[str]:
    """`key=value` arguments, with keys that are not identifiers passed as `**{...}`."""
    args = [f"{k}={_literal(v)}" for k, v in values.items() if k.isidentifier()]
    odd = {k: v for k, v in values.items() if not k.isidentifier()}
    return args + ([f"**{_literal_dict(odd)}"] if odd else [])


def _text_expression(text: str) -> str:
    """A Python expression for `text`: one token written N times (a template that spells
    out every image feature) as `"token" * N`, else the quoted text."""
    for size in range(1, len(text) // 2 + 1):
        unit, count = text[:size], len(text) // size
        if count >= 8 and unit * count == text:
            return f"{_str(unit)} * {count}"
    return _str(text)


def _vision_template_source(d: Discovery) -> str:
    plan = d.tiny.media
    named = _literal_dict({k: _Raw(_str(v)) for k, v in plan.named_tokens.items()})
    media = [_text_expression(plan.image_placeholder)]
    if plan.video_placeholder:
        media.append(_text_expression(plan.video_placeholder))
    return "\n".join([
        "# The tokens the processor and config name, each one atomic token of the tiny tokenizer.",
        f"NAMED_TOKENS = {named}",
        f"EXTRA_TOKENS = {_tuple(plan.literals)}",
        "# ChatML with the processor's placeholder where an image (or video) part stands.",
        _call("CHAT_TEMPLATE = chatml_with_media", media, indent=""),
    ])


class _Raw(str):
    """Source text to be written as is by `_literal_dict`."""

    def __repr__(self) -> str:
        return str(self)


def _tiny_vision_source(d: Discovery) -> list[str]:
    plan = d.tiny.media
    indent, width = " " * 4, 112  # the body of tiny(), before the class indent is added
    text_args = [f'"transformers:{plan.text_config_class}"', "tokenizer", *_keyword_args(plan.text_overrides)]
    own_text = plan.top_text_key is None  # the composite is its own text config: one call builds it
    config = text_args[2:] if own_text else [f"{plan.top_text_key}=text.to_dict()"]
    config.append(f"{plan.vision_key}=vision")
    config += [f"{k}=tokenizer.convert_tokens_to_ids({_str(t)})" for k, t in plan.token_fields.items()]
    if plan.top:
        config.append(f"**{_literal_dict(plan.top)}")
    processor = ["tokenizer=tokenizer"]
    for argument, (cls_name, kwargs) in plan.sub_processors.items():
        made = f"transformers.{cls_name}({', '.join(_keyword_args(kwargs))})"
        processor.append(f"{argument}=as_loaded({made})" if argument == "image_processor" else f"{argument}={made}")
    processor += [f"{k}={v}" for k, v in plan.processor_kwargs.items()]
    source = textwrap.dedent("""\
        def tiny(self) -> TinyModel:
            import transformers

            tokenizer = char_tokenizer(
                special_tokens=(*CHATML_SPECIAL_TOKENS, *EXTRA_TOKENS), named_tokens=NAMED_TOKENS,
                bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
                chat_template=CHAT_TEMPLATE,
            )
            text = @TEXT@
            # The default vision tower, shrunk; its image and patch size are kept and the
            # image processor resizes to that image size.
            vision = @VISION@
            config = @CONFIG@
            processor = @PROCESSOR@
            processor.chat_template = CHAT_TEMPLATE  # set after: not every processor takes one
            return TinyModel(config=config, processor=processor)
        """)
    if own_text:
        source = source.replace("    text = @TEXT@\n", "")
        made = _call("sized_config", [*text_args[:2], *config], indent, width)
    else:
        made = _call(f"transformers.{d.resolved.config_class}", config, indent, width)
    source = (source.replace("@TEXT@", _call("sized_config", text_args, indent, width))
              .replace("@VISION@", _literal_dict(plan.vision))
              .replace("@CONFIG@", made)
              .replace("@PROCESSOR@", _call(f"transformers.{plan.processor_class}", processor, indent, width)))
    return textwrap.indent(source, "    ").rstrip().split("\n")

def render_test(d: Discovery, layout: Layout) -> str:
    if layout.in_tree:
        return textwrap.dedent(f'''\
            """The zoo suite (tests/test_zoo.py) for the {d.family} family alone.

                .venv/bin/python -m pytest -q tests/test_family_{d.family}.py
            """

            import inspect

            import pytest

            import test_zoo

            FAMILY = {_str(d.family)}


            def zoo_checks():
                """Each zoo test whose family parametrization includes FAMILY."""
                for name, check in vars(test_zoo).items():
                    if not name.startswith("test_") or not callable(check):
                        continue
                    marks = [m for m in getattr(check, "pytestmark", []) if m.name == "parametrize"]
                    if all(FAMILY in m.args[1] for m in marks if m.args[0] == "family"):
                        yield pytest.param(check, id=name.removeprefix("test_"))


            @pytest.mark.parametrize("check", list(zoo_checks()))
            def test_zoo(check, tmp_ckpt):
                arguments = {{"family": FAMILY, "tmp_ckpt": tmp_ckpt}}
                check(**{{k: v for k, v in arguments.items() if k in inspect.signature(check).parameters}})
            ''')
    return textwrap.dedent(f'''\
        """Zoo checks for the out-of-tree {d.family} family: save/reload, forward/backward,
        generation, padded == single, packed == padded, parts, LoRA merge (and for a
        vision-language family, images that train its tower).

            python -m pytest -q tests/test_family_{d.family}.py
        """

        import importlib
        import sys
        from pathlib import Path

        import pytest
        import torch

        from mmrl import build_model, load_model
        from mmrl.checks import (
            generate, lora_merge_difference, logits_of, loss_and_backward, packed_boundary_gap,
            packed_vs_padded, padded_vs_single, sample_conversations{", tower_learns" if d.resolved.is_vision_language else ""},
        )
        from mmrl.parts import check_parts, parameters_by_part

        # Importing the module registers the family (an installed package also loads it
        # through its `mmrl.models` entry point).
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        importlib.import_module({_str(layout.adapter_module)})

        FAMILY = {_str(d.family)}
        TOLERANCE = 2e-4


        def test_save_reload_forward_backward_generate(tmp_path):
            built = build_model(FAMILY, random_init=True)
            conversations = sample_conversations(built.adapter)
            before = logits_of(built.model.eval(), built.inputs(conversations))
            built.save(tmp_path)
            reloaded = load_model(tmp_path)
            assert torch.allclose(before, logits_of(reloaded.model.eval(), reloaded.inputs(conversations)), atol=1e-5)
            assert torch.isfinite(loss_and_backward(reloaded, conversations))
            assert generate(reloaded, conversations, max_new_tokens=8).shape == (len(conversations), 8)


        def test_parts_cover_the_model():
            built = build_model(FAMILY, random_init=True)
            assert check_parts(built.model) == []
            groups = parameters_by_part(built.model)
            assert None not in groups, f"parameters in no part: {{[n for n, _ in groups[None]][:5]}}"


        def test_padded_batch_matches_each_prompt_alone():
            built = build_model(FAMILY, random_init=True)
            assert padded_vs_single(built, sample_conversations(built.adapter)) < TOLERANCE


        def test_packed_batch_matches_padded():
            built = build_model(FAMILY, random_init=True)
            if not built.adapter.capabilities.padding_free:
                pytest.skip("padding_free is not declared")
            assert packed_vs_padded(built, sample_conversations(built.adapter)) < TOLERANCE
            assert packed_boundary_gap(built).exact  # no state crosses a packed sequence boundary


        def test_lora_merge_matches_unmerged():
            built = build_model(FAMILY, random_init=True)
            if not built.adapter.capabilities.lora_language:
                pytest.skip("lora_language is not declared")
            gap, effect = lora_merge_difference(built, sample_conversations(built.adapter), "language")
            assert effect > 1e-3 and gap < TOLERANCE
        ''') + (_TOWER_TEST if d.resolved.is_vision_language else "")


# The generated test of a vision-language family that the images reach its tower's weights.
_TOWER_TEST = textwrap.dedent('''\


    def test_images_train_the_vision_tower():
        built = build_model(FAMILY, random_init=True)
        if not built.adapter.capabilities.single_image:
            pytest.skip("single_image is not declared")
        loss_and_backward(built, sample_conversations(built.adapter))
        assert tower_learns(built)
    ''')


def render_processing(d: Discovery) -> str:
    text_kwargs = d.tiny.media.text_kwargs if d.tiny is not None and d.tiny.media is not None else {}
    lines = ['    """The generic processing, under this family\'s name."""']
    if text_kwargs:
        lines = ['    """The generic processing; the model reads media token types, so the processor',
                 '    is asked for them."""',
                 "",
                 "    def text_kwargs(self):",
                 f"        return {_literal_dict(text_kwargs)}"]
    if d.tiny is not None and d.tiny.media is not None and d.tiny.media.flat_images:
        lines += ["",
                  "    def arrange_images(self, images):",
                  '        """The processor takes one flat image list (it refuses one list per prompt)."""',
                  "        return [image for per_sample in images for image in per_sample]"]
    head = textwrap.dedent(f"""\
        \"\"\"{d.class_name} input processing (scaffolded by `mmrl add-model {d.resolved.model_type}`).

        The generic `Processing` renders the chat template and calls the HF processor; a
        family subclasses it for what differs. The pixel budget (`min_pixels` /
        `max_pixels`) is not mapped onto this processor's arguments, so images keep the
        processor's own size; override `image_kwargs` to honour a budget.
        \"\"\"

        from mmrl.processing import Processing


        class {d.class_name}Processing(Processing):
        """)
    return head + "\n".join(lines) + "\n"


