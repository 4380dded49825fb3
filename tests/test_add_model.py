"""`mmrl add-model`: a real transformers family mmrl does not register is scaffolded
into a temporary out-of-tree package, loaded as a plugin, and must pass the zoo's
checks with no hand edits; the refusals (unknown, registered, existing files) write
nothing.

    .venv/bin/python -m pytest -q tests/test_add_model.py
"""

import dataclasses
import inspect
import tomllib

import pytest
import test_zoo
from typer.testing import CliRunner

from mmrl.cli import app
from mmrl.registry import get_adapter, load_plugin

TEXT_TYPE = "olmo2"  # in transformers, not in the zoo


def add_model(*args: str):
    return CliRunner().invoke(app, ["add-model", *args])


def zoo_checks(family: str):
    """The zoo tests a family of this kind joins (those parametrized over vision-language
    families only are left out for a text family)."""
    multimodal = get_adapter(family).is_multimodal
    for name, check in vars(test_zoo).items():
        if not name.startswith("test_") or not callable(check):
            continue
        marks = [m.args[1] for m in getattr(check, "pytestmark", []) if m.name == "parametrize"]
        vlm_only = any(families and all(get_adapter(f).is_multimodal for f in families) for families in marks)
        if multimodal or not vlm_only:
            yield name, check


@pytest.mark.slow
def test_text_family_scaffold_passes_the_zoo_unedited(plugin_path, tmp_ckpt):
    result = add_model(TEXT_TYPE, "--out", str(plugin_path), "--no-depth")
    assert result.exit_code == 0, result.output
    package = plugin_path / f"mmrl_{TEXT_TYPE}"
    adapter_file = package / f"{TEXT_TYPE}.py"
    assert adapter_file.is_file() and (package / "__init__.py").is_file()
    assert (plugin_path / "tests" / f"test_family_{TEXT_TYPE}.py").is_file()
    assert not (package / "processing.py").exists(), "a text family needs no processing module"
    pyproject = tomllib.loads((plugin_path / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"]["mmrl.models"] == {TEXT_TYPE: f"mmrl_{TEXT_TYPE}.{TEXT_TYPE}"}
    assert f"pytest -q tests/test_family_{TEXT_TYPE}.py" in result.output

    source = adapter_file.read_text()
    assert "parts = DECODER_PARTS" in source and f'model_types = ("{TEXT_TYPE}",)' in source
    assert "Olmo2DecoderLayer" in source and 'vllm_architecture="Olmo2ForCausalLM"' in source

    load_plugin(f"mmrl_{TEXT_TYPE}")  # the package registers its family (`mmrl --plugin mmrl_olmo2`)
    adapter = get_adapter(TEXT_TYPE)
    assert adapter.family == TEXT_TYPE and adapter.capabilities.padding_free
    ran = []
    for name, check in zoo_checks(TEXT_TYPE):
        arguments = {"family": TEXT_TYPE, "tmp_ckpt": tmp_ckpt / name}
        check(**{k: v for k, v in arguments.items() if k in inspect.signature(check).parameters})
        ran.append(name)
    assert {"test_save_reload_forward_backward_generate", "test_padded_batch_matches_each_prompt_alone",
            "test_packed_batch_matches_padded", "test_lora_merge_matches_unmerged"} <= set(ran)


@pytest.mark.slow
def test_a_recurrent_family_that_cannot_take_left_padding_is_scaffolded_right_padded(plugin_path, tmp_ckpt):
    """RWKV's forward ignores the mask, so pads in front enter its recurrent state: a
    left-padded batch differs from each prompt alone with counted and with its own
    positions. The scaffold declares left_padding = False (a right-padded batch matches),
    the zoo's padded-batch test passes on the adapter unedited, and the engine's log-probs
    of a batch equal each sequence's alone."""
    result = add_model("rwkv", "--out", str(plugin_path), "--no-depth")
    assert result.exit_code == 0, result.output
    assert "fill in" not in result.output, result.output
    load_plugin("mmrl_rwkv.rwkv")
    adapter = get_adapter("rwkv")
    assert adapter.left_padding is False and not adapter.capabilities.padding_free
    assert "left_padding = False" in (plugin_path / "mmrl_rwkv" / "rwkv.py").read_text()
    checks = dict(zoo_checks("rwkv"))
    for name in ("test_padded_batch_matches_each_prompt_alone", "test_save_reload_forward_backward_generate"):
        check = checks[name]
        arguments = {"family": "rwkv", "tmp_ckpt": tmp_ckpt / name}
        check(**{k: v for k, v in arguments.items() if k in inspect.signature(check).parameters})
    import torch

    from mmrl import build_model
    from mmrl.checks import sample_conversations
    from mmrl.engine import Engine, join
    from mmrl.parallel import init_distributed

    built = build_model("rwkv", random_init=True, seed=0)
    engine = Engine(built, init_distributed("cpu"))
    conversations = sample_conversations(built.adapter)
    responses = torch.tensor([[11, 12, 13], [21, 22, 0]])

    def joined(rows, answers):
        prompts = dict(built.processing(rows))
        return join(prompts, answers, (answers != 0).long(), built.adapter, built.model, built.tokenizer.pad_token_id)

    with torch.no_grad():
        logp, _ = engine.log_probs(joined(conversations, responses))
        for i, conversation in enumerate(conversations):
            alone, _ = engine.log_probs(joined([conversation], responses[i:i + 1]))
            real = responses[i] != 0
            torch.testing.assert_close(logp[i][real], alone[0][real], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_type_without_a_processor_class_takes_the_one_of_the_model_it_derives_from(plugin_path, tmp_ckpt):
    """GLM-OCR has no processor class in transformers' table nor in its package; its
    modular source derives its model from GLM-4V's, so the scaffold builds GLM-4V's
    processor, and the adapter passes the zoo's checks unedited."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from mmrl.scaffold.media import _derived_from, _processor_class

    assert _derived_from(CONFIG_MAPPING["fast_vlm"]) == ["llava"]
    assert _processor_class("glm_ocr", CONFIG_MAPPING["glm_ocr"]).__name__ == "Glm4vProcessor"
    assert _processor_class("qwen2_vl", CONFIG_MAPPING["qwen2_vl"]).__name__ == "Qwen2VLProcessor"  # the table first
    result = add_model("glm_ocr", "--out", str(plugin_path), "--no-depth")
    assert result.exit_code == 0, result.output
    assert "fill in" not in result.output, result.output
    load_plugin("mmrl_glm_ocr.glm_ocr")
    adapter = get_adapter("glm_ocr")
    assert adapter.capabilities.single_image
    checks = dict(zoo_checks("glm_ocr"))
    for name in ("test_save_reload_forward_backward_generate", "test_padded_batch_matches_each_prompt_alone"):
        check = checks[name]
        arguments = {"family": "glm_ocr", "tmp_ckpt": tmp_ckpt / name}
        check(**{k: v for k, v in arguments.items() if k in inspect.signature(check).parameters})


def test_unknown_model_type_is_a_one_line_error(tmp_path):
    result = add_model("no_such_model_type", "--out", str(tmp_path / "out"))
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0
    assert "unknown model type 'no_such_model_type'" in result.output
    assert not (tmp_path / "out").exists()


def test_registered_model_type_is_refused(tmp_path):
    result = add_model("qwen2", "--out", str(tmp_path))
    assert result.exit_code == 2
    assert "already registered by family 'qwen2'" in result.output
    assert list(tmp_path.iterdir()) == []


def test_existing_file_is_kept_without_force(tmp_path):
    test_file = tmp_path / "tests" / f"test_family_{TEXT_TYPE}.py"
    test_file.parent.mkdir()
    test_file.write_text("# mine\n")
    result = add_model(TEXT_TYPE, "--out", str(tmp_path), "--no-verify")
    assert result.exit_code == 2 and "--force" in result.output
    assert test_file.read_text() == "# mine\n"
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "tests", f"tests/test_family_{TEXT_TYPE}.py"], "a refused scaffold wrote files"

    result = add_model(TEXT_TYPE, "--out", str(tmp_path), "--no-verify", "--force")
    assert result.exit_code == 0, result.output
    assert test_file.read_text() != "# mine\n"
    assert "not checked while scaffolding" in (tmp_path / f"mmrl_{TEXT_TYPE}" / f"{TEXT_TYPE}.py").read_text()


def test_dry_run_writes_nothing(tmp_path):
    result = add_model(TEXT_TYPE, "--out", str(tmp_path / "out"), "--dry-run", "--no-verify")
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "out").exists()
    assert f"--- {tmp_path / 'out' / f'mmrl_{TEXT_TYPE}' / f'{TEXT_TYPE}.py'}" in result.output
    assert "class Olmo2(ModelAdapter):" in result.output


def test_in_tree_dry_run_targets_the_checkout(tmp_path):
    from mmrl.scaffold.layout import repo_root

    root = repo_root()
    result = add_model(TEXT_TYPE, "--family", "scaffold_probe", "--dry-run", "--no-verify")
    assert result.exit_code == 0, result.output
    for path in ("models/scaffold_probe.py", "tests/test_family_scaffold_probe.py", "docs/families.md"):
        assert f"--- {root / path}" in result.output
        assert path == "docs/families.md" or not (root / path).exists()
    assert "class ScaffoldProbe(ModelAdapter):" in result.output
    assert "- `scaffold_probe` (text): transformers `Olmo2ForCausalLM`" in result.output
    assert "import test_zoo" in result.output


VLM_TYPE = "mistral3"  # a vision-language type in transformers, not in the zoo
# One whose scaffolded tiny model does not run, and fails fast (~10 s; GIT, the one
# before it, runs since the scaffold lines up logits that run longer than input_ids):
# InstructBLIP-Video's processor writes four frames' query tokens for an image given as
# one frame, which nothing the processor gives away tells the scaffold.
FAILING_VLM = "instructblipvideo"


@pytest.mark.slow
def test_vision_language_scaffold_passes_the_zoo_unedited(plugin_path, tmp_ckpt):
    result = add_model(VLM_TYPE, "--out", str(plugin_path))
    assert result.exit_code == 0, result.output
    package = plugin_path / f"mmrl_{VLM_TYPE}"
    assert (package / "processing.py").is_file()
    source = (package / f"{VLM_TYPE}.py").read_text()
    assert "Fill in by hand" not in source
    # Its quick checks ran the media-sharing probe on a family the zoo never saw, and its
    # depth probes Ulysses over 2 processes and an image arriving in turn 3.
    assert "media_sharing=True" in source
    assert "sequence_parallel=True" in source and "multi_turn=True" in source, source

    load_plugin(f"mmrl_{VLM_TYPE}.{VLM_TYPE}")
    adapter = get_adapter(VLM_TYPE)
    assert adapter.is_multimodal and adapter.parts.vision and adapter.parts.projector
    ran = []
    for name, check in zoo_checks(VLM_TYPE):
        arguments = {"family": VLM_TYPE, "tmp_ckpt": tmp_ckpt / name}
        check(**{k: v for k, v in arguments.items() if k in inspect.signature(check).parameters})
        ran.append(name)
    assert {"test_freeze_vision", "test_multi_image_and_video", "test_padded_batch_matches_each_prompt_alone"} <= set(ran)


@pytest.mark.slow
def test_vision_language_scaffold_that_does_not_run_lists_what_to_fill_in(tmp_path):
    result = add_model(FAILING_VLM, "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "fill in: tiny(): the scaffolded tiny model does not run" in " ".join(result.output.split())
    source = (tmp_path / f"mmrl_{FAILING_VLM}" / f"{FAILING_VLM}.py").read_text()
    assert "Fill in by hand" in source and "capabilities = Capabilities.none()" in source
    assert "parts = Parts(" in source and "InstructBlipVideoEncoderLayer" in source


def test_in_tree_scaffold_writes_models_tests_and_docs(tmp_path, monkeypatch):
    import ast

    from mmrl.scaffold import layout

    for folder in ("models", "processors", "tests", "docs"):
        (tmp_path / folder).mkdir()
    (tmp_path / "docs" / "families.md").write_text("# Model families\n\n- `qwen2` (text): ...\n")
    monkeypatch.setattr(layout, "repo_root", lambda: tmp_path)
    result = add_model(TEXT_TYPE, "--no-verify")
    assert result.exit_code == 0, result.output
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["docs/families.md", f"models/{TEXT_TYPE}.py", f"tests/test_family_{TEXT_TYPE}.py"]
    for path in written[1:]:
        ast.parse((tmp_path / path).read_text())
    assert (tmp_path / "docs" / "families.md").read_text().splitlines()[2:] == [
        "- `qwen2` (text): ...",
        f"- `{TEXT_TYPE}` (text): transformers `Olmo2ForCausalLM`, [models/{TEXT_TYPE}.py](../models/{TEXT_TYPE}.py), "
        f"scaffolded by `mmrl add-model {TEXT_TYPE}`",
    ]
    assert f"pytest -q tests/test_family_{TEXT_TYPE}.py" in result.output


@pytest.mark.slow
def test_coverage_sweep_slice_writes_rows_and_resumes(tmp_path):
    """A small fixed slice of the coverage sweep (`mmrl add-model --sweep`): a text type
    that scaffolds green, an encoder that the scope rule removes, a VLM whose tiny model
    does not run (one line naming the stage); a second run adds rows and keeps the first.
    Its green text row repeats test_text_family_scaffold_passes_the_zoo_unedited's check
    (the zoo's tests on the olmo2 scaffold, here through the generated test file in a
    process of its own) and its git row the finding of
    test_vision_language_scaffold_that_does_not_run_lists_what_to_fill_in (the tiny model
    does not run); what it adds is the sweep's rows, resume, page and depth columns
    (Ulysses over 2 processes)."""
    import json

    coverage = tmp_path / "coverage.json"
    result = add_model("--sweep", "--types", f"{TEXT_TYPE},bert", "--coverage", str(coverage), "--no-progress")
    assert result.exit_code == 0, result.output
    first = json.loads(coverage.read_text())
    rows = {r["model_type"]: r for r in first["types"]}
    assert set(rows) == {TEXT_TYPE, "bert"} and first["transformers"]
    assert rows[TEXT_TYPE]["status"] == "green" and rows[TEXT_TYPE]["in_scope"]
    assert {"generation", "padding_free", "sequence_parallel"} <= set(rows[TEXT_TYPE]["capabilities"])
    # A column per capability: Ulysses over 2 gloo processes verified; no media columns for text.
    assert rows[TEXT_TYPE]["columns"]["sequence_parallel"] == "yes"
    assert rows[TEXT_TYPE]["columns"]["multi_turn"] == rows[TEXT_TYPE]["columns"]["single_image"] == "n/a"
    assert rows["bert"] == {**rows["bert"], "in_scope": False, "status": "out-of-scope", "scope_rule": "encoder"}
    assert first["summary"]["causal_lm"]["in_scope"] == 1 and first["summary"]["causal_lm"]["green"] == 1

    result = add_model("--sweep", "--types", FAILING_VLM, "--coverage", str(coverage), "--no-progress")
    assert result.exit_code == 0, result.output
    rows = {r["model_type"]: r for r in json.loads(coverage.read_text())["types"]}
    assert set(rows) == {TEXT_TYPE, "bert", FAILING_VLM}, "the second run must keep the first run's rows"
    failing = rows[FAILING_VLM]
    assert failing["status"] == "tiny-model-fails" and failing["stage"] == "verify"
    assert "\n" not in failing["reason"] and "does not run" in failing["reason"]
    page = coverage.with_suffix(".md").read_text()
    assert f"| `{TEXT_TYPE}` | causal_lm | green |" in page and "encoder** (1 types)" in page

    result = add_model("--sweep", "--types", "no_such_type", "--coverage", str(coverage), "--no-progress")
    assert result.exit_code == 2 and "no_such_type" in result.output


def test_scope_rule_is_read_from_transformers_tables():
    from mmrl.scaffold.sweep import scope_rule

    assert scope_rule("bert") == "encoder"
    assert scope_rule("bart") == "seq2seq"
    assert scope_rule("whisper") == "audio"
    assert scope_rule(TEXT_TYPE) is None and scope_rule(VLM_TYPE) is None


def test_processor_tokens_read_only_when_the_tokenizer_has_them_stay_unset():
    # Blip2Processor reads tokenizer.image_token only `if hasattr(...)` and otherwise adds
    # its own AddedToken("<image>"): the tiny tokenizer must leave the attribute unset.
    import transformers

    from mmrl.scaffold.placeholders import tokens_in_source

    named, literals, optional = tokens_in_source(transformers.Blip2Processor)
    assert optional == {"image_token": "<image>"} and "image_token" not in named
    named, _, optional = tokens_in_source(transformers.PaliGemmaProcessor)
    assert "add_bos_token" not in named and "add_bos_token" not in optional, "a tokenizer switch is not a token"


def test_multi_axis_rope_split_written_in_model_code_is_rescaled_with_equal_axes_kept():
    from mmrl.scaffold.shrink import _modeling_default, _rescaled_mrope, tiny_text_values

    import transformers

    # Glm4v's default config has no mrope_section; its model code falls back to [8, 12, 12].
    assert _modeling_default(transformers.Glm4vTextConfig, "mrope_section") == [8, 12, 12]
    values = tiny_text_values("Glm4vTextConfig")
    head_dim = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    assert values["rope_parameters"]["mrope_section"] == [4, 6, 6] and sum([4, 6, 6]) == head_dim // 2
    # Height and width sections that are equal stay equal (a model interleaves them).
    scaled = _rescaled_mrope({"mrope_section": [22, 22, 20]}, {"hidden_size": 64, "num_attention_heads": 2}, None)
    assert scaled["mrope_section"][0] == scaled["mrope_section"][1] and sum(scaled["mrope_section"]) == 16


def test_a_model_that_always_interleaves_its_rope_axes_says_so_in_the_tiny_config():
    """Qwen3-VL's code interleaves height and width over every third frequency and reads no
    flag; vLLM reads `mrope_interleaved` (released checkpoints set it) and without it
    rotates the axes in blocks, which put the scaffolded qwen3_vl's log-probs 1e-2 off the
    trainer's."""
    from mmrl.scaffold.shrink import tiny_text_values

    interleaved = tiny_text_values("Qwen3VLTextConfig")["rope_parameters"]
    assert interleaved["mrope_interleaved"] is True and interleaved["mrope_section"]
    blocks = tiny_text_values("Qwen2VLTextConfig")["rope_parameters"]  # sections in blocks
    assert blocks["mrope_section"] and "mrope_interleaved" not in blocks


def test_processor_token_names_are_read_through_aliases_and_frame_words():
    import transformers

    from mmrl.scaffold.placeholders import _frames, named_token, tokens_in_source

    # InternVLProcessor: `self.image_token = tokenizer.context_image_token`.
    named, _, _ = tokens_in_source(transformers.InternVLProcessor)
    assert named["image_token"] == named["context_image_token"]
    # A config field's stem finds the processor's token under another frame word.
    named = {"vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>", "image_token": "<i>"}
    assert named_token("vision_start", named) == "<|vision_bos|>"
    assert named_token("vision_end", named) == "<|vision_eos|>"
    assert named_token("audio_start", named) is None
    assert _frames(named) == [("<|vision_bos|>", "<|vision_eos|>")]
    # The chat template's own message markers are no media frame.
    assert _frames({"message_start_token": "<|im_start|>", "message_end_token": "<|im_end|>"}) == []


def test_image_processor_sizes_follow_a_height_width_tower_size():
    import transformers

    from mmrl.scaffold.image_size import sized_processor_kwargs

    sized = sized_processor_kwargs(transformers.GotOcr2ImageProcessor, [448, 336])
    assert sized["size"] == {"height": 448, "width": 336}


@pytest.mark.parametrize("model_type, vision, projector, positions", [
    # A Q-Former beside the tower, a whole causal LM nested in the VLM, a processor that
    # places the image tokens itself and keeps no chat template.
    ("blip-2", ("vision_model",), {"qformer", "language_projection", "query_tokens"}, None),
    # The projector (merger, downsampling) sits inside the vision tower. The model computes
    # its mrope positions (get_rope_index): written out, they keep packed rows and shared
    # media right, which the model's own do not.
    ("glm4v", ("model.visual",), {"model.visual.merger", "model.visual.downsample"},
     "return rope_index_positions(model, batch)"),
    # Positions offset by the model's own code (sinusoidal, past the padding index):
    # counted positions fail padded-vs-single, the model's own pass.
    ("kosmos-2", ("vision_model",), {"image_to_text_projection"}, "return None"),
])
@pytest.mark.slow
def test_vision_language_layouts_beyond_siblings(model_type, vision, projector, positions, plugin_path,
                                                 tmp_ckpt):
    result = add_model(model_type, "--out", str(plugin_path), "--no-depth")  # layouts, not depth
    assert result.exit_code == 0, result.output
    assert "fill in" not in result.output, result.output
    family = model_type.replace("-", "_")
    load_plugin(f"mmrl_{family}.{family}")
    adapter = get_adapter(family)
    assert adapter.parts.vision == vision and set(adapter.parts.projector) == projector
    assert adapter.capabilities.single_image
    source = inspect.getsource(type(adapter))
    assert ("def position_ids" in source) == (positions is not None)
    if positions is not None:
        assert positions in source.split("def position_ids", 1)[1].split("def ", 1)[0]
    if "rope_index_positions" in (positions or ""):
        assert adapter.capabilities.padding_free and adapter.capabilities.media_sharing
    checks = dict(zoo_checks(family))
    for name in ("test_save_reload_forward_backward_generate", "test_freeze_vision",
                 "test_padded_batch_matches_each_prompt_alone"):
        check = checks[name]
        arguments = {"family": family, "tmp_ckpt": tmp_ckpt / name}
        check(**{k: v for k, v in arguments.items() if k in inspect.signature(check).parameters})


@pytest.mark.parametrize("model_type, rule, verify", [
    # The model code reads config.vision_start_token_id, which its config class lacks;
    # the processor names that token vision_bos_token.
    ("qwen2_5_omni_thinker", "token_id_read_by_model_code", True),
    # The processor takes `img_size`, the config's vision_config.image_size.
    ("aya_vision", "img_size", True),
    # The processor refuses one image list per prompt: the processing flattens them.
    # Written without the scaffold's own quick checks: its tower reads 1024-pixel images
    # (some 80 s of CPU for those checks' eight forward-backward passes, the media-sharing
    # probe's two updates among them); the zoo checks below run its tiny model, and the
    # coverage sweep (support_matrix/coverage.json) records the capabilities they declare.
    ("got_ocr2", "flat_images", False),
    # The projector takes vision_output_dim, the tower's width times its tapped layers plus
    # one (7680 by default): fitted to the width the tiny tower gives (`_input_widths_fitted`).
    ("mllama", "fitted_width", True),
    # Two towers built from the vision sub-config (images, video frames): both the vision part.
    ("video_llava", "twin_towers", True),
])
@pytest.mark.slow
def test_vision_language_scaffolds_read_what_their_processor_and_model_code_need(model_type, rule, verify,
                                                                               plugin_path, tmp_ckpt):
    checks = "--no-depth" if verify else "--no-verify"  # layouts, not depth
    result = add_model(model_type, "--out", str(plugin_path), checks)
    assert result.exit_code == 0, result.output
    assert "fill in" not in result.output, result.output
    package = plugin_path / f"mmrl_{model_type}"
    source = (package / f"{model_type}.py").read_text()
    if rule == "token_id_read_by_model_code":
        assert 'vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_bos|>")' in source
        assert "<|vision_bos|><|image|><|vision_eos|>" in source
    elif rule == "img_size":
        assert "img_size=config.vision_config.image_size" in " ".join(source.split())
    elif rule == "fitted_width":
        assert '"intermediate_layers_indices": [1]' in source and '"vision_output_dim": 64' in source
        # Its cross-attention gates start at zero: drawn, so that the images train the tower.
        assert '"model.language_model.layers.*.cross_attn_attn_gate",' in source
        assert "single_image=True" in source
    elif rule == "twin_towers":
        assert 'vision=("model.video_tower", "model.image_tower")' in source and "single_image=True" in source
    else:
        assert "def arrange_images" in (package / "processing.py").read_text()
    load_plugin(f"mmrl_{model_type}.{model_type}")
    checks = dict(zoo_checks(model_type))
    for name in ("test_save_reload_forward_backward_generate", "test_padded_batch_matches_each_prompt_alone"):
        check = checks[name]
        arguments = {"family": model_type, "tmp_ckpt": tmp_ckpt / name}
        check(**{k: v for k, v in arguments.items() if k in inspect.signature(check).parameters})


@pytest.mark.slow
def test_a_framed_placeholder_must_expand_not_just_pass_through():
    # QianfanOCRProcessor expands `<image>` into start + context tokens + end; a framed
    # `<|start_image|><|context_image|><|end_image|>` in the text passes through as is
    # and must not be taken for the placeholder.
    from mmrl.scaffold import quiet_transformers
    from mmrl.scaffold.resolve import resolve
    from mmrl.scaffold.tiny_inputs import tiny_model_inputs

    with quiet_transformers():
        plan = tiny_model_inputs(resolve("qianfan_ocr")).media
    assert plan.image_placeholder == "<image>"
    assert plan.token_fields["image_token_id"] == plan.named_tokens["context_image_token"]


@pytest.mark.slow
def test_the_video_placeholder_is_found_the_way_a_run_processes_a_clip():
    """Glm4vProcessor samples a clip's frames by its fps unless told the frames are
    sampled already; called with bare frames it refused every candidate, so the type had
    no video placeholder and its video column read n/a. Found through mmrl's processing
    (sampled frames, their metadata passed), the placeholder is the one whose tokens the
    processor types as video: inside the `<|begin_of_video|>` / `<|end_of_video|>` pair
    its code spells out, not the bare token (typed as an image) nor the config's pair."""
    from mmrl.checks import sample_video
    from mmrl.scaffold import quiet_transformers
    from mmrl.scaffold.media_plan import build_config, build_processor
    from mmrl.scaffold.placeholders import _processing
    from mmrl.scaffold.resolve import resolve
    from mmrl.scaffold.tiny_inputs import tiny_model_inputs

    with quiet_transformers():
        plan = tiny_model_inputs(resolve("glm4v")).media
    assert plan.video_placeholder == "<|begin_of_video|><|video|><|end_of_video|>"
    assert plan.image_placeholder.startswith(plan.token_fields["image_start_token_id"])
    with quiet_transformers():
        tokenizer, config = build_config(resolve("glm4v"), plan)
        processing = _processing(build_processor(plan, tokenizer, config), plan.text_kwargs)
    clip = processing.load_video(sample_video())
    for placeholder, typed in ((plan.video_placeholder, True), ("<|video|>", False)):
        batch = processing.process_texts([f"look {placeholder} here"], [([], [clip])])
        assert bool((batch["mm_token_type_ids"] == 2).any()) is typed
        assert int((batch["mm_token_type_ids"] > 0).sum()) > 4  # the clip's tokens, typed either way


@pytest.mark.slow
def test_a_patch_size_no_config_gives_is_measured_on_the_tiny_tower():
    """LlavaProcessor cannot expand an image without `patch_size`, which FastVLM's timm
    tower config does not hold: the placeholder search had nothing to see and the type
    stopped at the processor stage. A stand-in lets the search see the expansion; then the
    patch size is the processed image's side over the tiny tower's feature grid's side."""
    from mmrl.scaffold import quiet_transformers
    from mmrl.scaffold.image_size import STAND_IN_PATCH
    from mmrl.scaffold.media_plan import build_config, build_processor, runs_with_image
    from mmrl.scaffold.resolve import resolve
    from mmrl.scaffold.tiny_inputs import tiny_model_inputs

    resolved = resolve("fast_vlm")
    with quiet_transformers():
        plan = tiny_model_inputs(resolved).media
        assert plan.unset_patch == "patch_size" and plan.image_placeholder == "<image>"
        measured = plan.processor_kwargs["patch_size"]
        assert measured != str(STAND_IN_PATCH)
        tokenizer, config = build_config(resolved, plan)
        assert runs_with_image(resolved.model_class, config, build_processor(plan, tokenizer, config),
                               plan.image_placeholder, plan.text_kwargs) is None
        plan.processor_kwargs["patch_size"] = str(int(measured) // 2)  # four times the tokens: no fit
        assert runs_with_image(resolved.model_class, config, build_processor(plan, tokenizer, config),
                               plan.image_placeholder, plan.text_kwargs) is not None


@pytest.mark.slow
def test_the_placeholder_is_framed_by_the_start_and_end_tokens_the_config_names():
    """Qwen3VLProcessor names no frame tokens, but the config names vision_start and
    vision_end token ids: each image is written inside them, as released templates do, so
    that two images in a row stay two runs (transformers' get_rope_index takes one grid a
    run) and the scaffold's multi-image check can pass. A processor that frames its images
    itself (qianfan_ocr, above) keeps its bare placeholder."""
    from mmrl.scaffold import quiet_transformers
    from mmrl.scaffold.resolve import resolve
    from mmrl.scaffold.tiny_inputs import tiny_model_inputs

    with quiet_transformers():
        plan = tiny_model_inputs(resolve("qwen3_vl")).media
    start, end = plan.token_fields["vision_start_token_id"], plan.token_fields["vision_end_token_id"]
    assert plan.image_placeholder == f"{start}<|image_pad|>{end}"
    assert plan.token_fields["image_token_id"] == "<|image_pad|>"


@pytest.mark.slow
def test_rope_positions_are_written_out_only_where_they_are_the_models_own_on_video(plugin_path):
    """Qwen2.5-Omni's get_rope_index takes a video's seconds per grid under another name
    than the batch gives them (`second_per_grids`, `video_second_per_grid`): written out
    by name, a video batch fails where the model's own positions run. Packing would have
    verified with them (the quick checks hold no video), but the adapter keeps the model's
    own, and so its video (glm4v above, whose written positions equal its own, writes them)."""
    result = add_model("qwen2_5_omni_thinker", "--out", str(plugin_path), "--no-depth")
    assert result.exit_code == 0, result.output
    source = (plugin_path / "mmrl_qwen2_5_omni_thinker" / "qwen2_5_omni_thinker.py").read_text()
    assert "rope_index_positions" not in source


def test_an_adapter_that_writes_the_models_rope_index_out_renders_it():
    from scaffold_setup import discovered, rendered

    found = discovered("qwen2_vl", "rope_written")
    assert "rope_index_positions" not in rendered(found)
    found.rope_index_positions = True
    source = rendered(found)
    compile(source, "rendered", "exec")
    assert "from mmrl.positions import rope_index_positions" in source
    assert "        return rope_index_positions(model, batch)" in source


def test_a_width_a_layer_expects_is_fitted_to_the_one_the_tiny_tower_gives(monkeypatch):
    """A matmul error naming the width a layer takes (a vision config field) and the width
    it is given: that field set to the given width, as long as one field holds it."""
    from types import SimpleNamespace

    from mmrl.scaffold import image_size

    defaults = {"hidden_size": 1280, "vision_output_dim": 7680, "num_hidden_layers": 32}

    def built(resolved, plan):
        return "tokenizer", SimpleNamespace(vision_config=SimpleNamespace(to_dict=lambda: {**defaults, **plan.vision}))

    def run(model_class, config, processor, placeholder, text_kwargs):
        width = config.vision_config.to_dict()["vision_output_dim"]
        return None if width == 64 else f"RuntimeError: mat1 and mat2 shapes cannot be multiplied (8200x64 and {width}x64)"

    monkeypatch.setattr(image_size, "build_config", built)
    monkeypatch.setattr(image_size, "build_processor", lambda plan, tokenizer, config: "processor")
    monkeypatch.setattr(image_size, "runs_with_image", run)
    plan = SimpleNamespace(vision={"hidden_size": 32, "num_hidden_layers": 2}, vision_key="vision_config",
                           image_placeholder="<image>", text_kwargs=None)
    _, config = built(None, plan)
    fitted = image_size._input_widths_fitted(SimpleNamespace(model_class="M"), plan, config, run("M", config, 0, 0, 0))
    assert fitted is not None and fitted[1] is None and plan.vision["vision_output_dim"] == 64
    # Two fields of the expected width: neither is guessed, and the plan stays as it was.
    defaults["projector_dim"] = 7680
    plan.vision = {"hidden_size": 32}
    _, config = built(None, plan)
    assert image_size._input_widths_fitted(None, plan, config, run("M", config, 0, 0, 0)) is None
    assert plan.vision == {"hidden_size": 32}


def test_weights_initialized_to_zero_are_found_and_drawn():
    """`zero_weights` names the all-zero weights of a random init (layer indices as `*`),
    biases and norms aside; `redraw_zeros` draws the ones its patterns name, nothing else."""
    import torch

    from mmrl.scaffold.verify import zero_weights
    from mmrl.tiny import redraw_zeros

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Parameter(torch.zeros(1))
            self.proj = torch.nn.Linear(4, 4)
            torch.nn.init.zeros_(self.proj.bias)
            self.norm = torch.nn.Parameter(torch.zeros(4))  # a (1 + weight) norm's weight

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Block(), Block()])
    model.projection = torch.nn.Parameter(torch.zeros(4, 4))
    model.config = type("Config", (), {"initializer_range": 0.5})()
    patterns = zero_weights(model)
    assert sorted(patterns) == ["layers.*.gate", "projection"]
    weight = model.layers[0].proj.weight.clone()
    redraw_zeros(model, patterns)
    assert all(block.gate.item() != 0 for block in model.layers) and model.projection.abs().sum() > 0
    assert torch.equal(model.layers[0].proj.weight, weight) and not model.layers[1].norm.any()
    assert zero_weights(model) == ()


def test_single_image_needs_a_gradient_in_the_vision_tower():
    """The scaffold's single_image check: the images must reach the tower's weights."""
    from mmrl import build_model
    from mmrl.checks import loss_and_backward, sample_conversations
    from mmrl.parts import parameters_by_part
    from mmrl.checks import tower_learns

    built = build_model("qwen2_vl", random_init=True)
    loss_and_backward(built, sample_conversations(built.adapter))
    assert tower_learns(built)
    for _, parameter in parameters_by_part(built.model, built.adapter)["vision"]:
        parameter.grad = None  # as where a zero gate stops the images
    assert not tower_learns(built)


def test_composite_config_width_follows_the_tiny_text_model():
    # Ovis2Config's defaults: a 1536-wide top level over a 4096-wide text default.
    from mmrl.scaffold import quiet_transformers
    from mmrl.scaffold.resolve import resolve
    from mmrl.scaffold.tiny_inputs import tiny_model_inputs

    with quiet_transformers():
        config = tiny_model_inputs(resolve("ovis2")).config
    assert config.hidden_size == config.text_config.hidden_size


def test_docs_state_the_committed_coverage():
    import json
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    summary = json.loads((root / "support_matrix" / "coverage.json").read_text())["summary"]
    text = " ".join((root / "docs" / "adding_a_model.md").read_text().split())
    found = re.search(r"\*\*(\d+) of (\d+)\*\* in-scope causal-LM types and \*\*(\d+) of (\d+)\*\* in-scope "
                      r"image-text-to-text types are green, \*\*(\d+)\*\* of those with image inputs", text)
    assert found, "docs/adding_a_model.md must state the sweep's figures"
    text_lm, vlm = summary["causal_lm"], summary["image_text_to_text"]
    assert [int(g) for g in found.groups()] == [text_lm["green"], text_lm["in_scope"], vlm["green"], vlm["in_scope"],
                                                vlm["green_with_images"]]


def test_the_summary_counts_green_image_types_that_declare_images():
    """A VLM type scaffolded as a text family (no image capability) is green but is not
    counted among those with image inputs; the causal-LM table has no such count."""
    from mmrl.scaffold.sweep import Row, summarize

    def row(model_type, status, capabilities):
        return Row(model_type=model_type, mapping="image_text_to_text", in_scope=True, status=status, stage="tests",
                   reason="", capabilities=capabilities)

    summary = summarize([row("a", "green", ["generation", "single_image"]), row("b", "green", ["generation"]),
                         row("c", "processor", [])])
    assert summary["image_text_to_text"]["green"] == 2
    assert summary["image_text_to_text"]["green_with_images"] == 1
    assert "green_with_images" not in summary["causal_lm"]


def test_sweep_names_a_killed_process_in_one_line():
    from mmrl.scaffold.sweep import _killed

    line = _killed(-9, "stage config")
    assert line.startswith("stage config: killed by SIGKILL") and "memory" in line and "\n" not in line
    assert _killed(-15, "the generated tests") == "the generated tests: killed by SIGTERM"


def test_sweep_names_the_failing_generated_test_and_what_to_write():
    from mmrl.scaffold.sweep import _tests_reason

    output = ("F\n=== FAILURES ===\nE       AssertionError: assert 0.0045 < 0.0002\n"
              "=== short test summary info ===\n"
              "FAILED tests/test_family_x.py::test_padded_batch_matches_each_prompt_alone - AssertionError: ...\n")
    reason = _tests_reason(output)
    assert reason.startswith("test_padded_batch_matches_each_prompt_alone: AssertionError: assert 0.0045 < 0.0002;")
    assert "position_ids" in reason and "\n" not in reason


def test_rope_per_layer_type_is_filled_where_the_model_code_reads_one_per_type():
    # CohereCompassTextConfig's defaults carry no rope entries, while its model code reads
    # rope_parameters[layer_type] (and a multi-axis split it falls back to).
    import transformers

    from mmrl.scaffold.shrink import tiny_text_values

    values = tiny_text_values("CohereCompassTextConfig")
    rope = values["rope_parameters"]
    assert set(rope) == set(transformers.CohereCompassTextConfig().layer_types)
    head_dim = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    for entry in rope.values():
        assert entry["rope_type"] == "default" and sum(entry["mrope_section"]) == head_dim // 2


def test_image_processor_pixel_budgets_are_sized_to_the_tower_area():
    # Glm4vImageProcessor's size holds pixel areas (a min/max budget), not edges.
    import transformers

    from mmrl.scaffold.image_size import sized_processor_kwargs

    sized = sized_processor_kwargs(transformers.Glm4vImageProcessor, 336)
    assert sized["size"]["longest_edge"] == 336 * 336
    assert sized["size"]["shortest_edge"] <= 336 * 336


def test_a_single_layer_index_stays_inside_the_shrunk_depth():
    import transformers

    from mmrl.scaffold.shrink import tiny_vision_values

    # The vision merger is inserted after layer 6 of 12; two layers deep it must still run.
    values = tiny_vision_values(transformers.MiniCPMV4_6VisionConfig(), 1024)
    assert values["num_hidden_layers"] == 2 and values["insert_layer_id"] == 1


def test_layer_indexes_follow_a_tower_that_counts_its_blocks_as_depth():
    """Qwen3-VL's tower counts its blocks as `depth` and feeds decoder layers from blocks
    8, 16 and 24 (DeepStack). Two blocks deep, an index list left at its default names
    no block: transformers then makes no DeepStack feature while vLLM expects one per
    index. The indexes are remapped into the shrunk depth, a subset staying a subset."""
    import transformers

    from mmrl.scaffold.shrink import tiny_vision_values

    values = tiny_vision_values(transformers.Qwen3VLVisionConfig(), 2048)
    assert values["depth"] == 2 and values["deepstack_visual_indexes"] == [1]
    # Qwen2.5-VL's full-attention blocks (7, 15, 23, 31 of 32; the others windowed).
    values = tiny_vision_values(transformers.Qwen2_5_VLVisionConfig(), 2048)
    assert values["depth"] == 2 and values["fullatt_block_indexes"] == [1]


def test_the_tiny_tower_keeps_the_composites_patch_geometry():
    """LLaVA's default CLIP tower cuts patches of 14; CLIPVisionConfig's own default is 32.
    The tiny tower, written as a dict over the class's defaults, must keep the 14 (a
    112-pixel image in patches of 32 has no whole grid, which vLLM's CLIP rejects)."""
    import transformers

    from mmrl.scaffold.shrink import composite_tower_values

    assert composite_tower_values(transformers.LlavaConfig().vision_config) == {"patch_size": 14}
    assert composite_tower_values(transformers.CLIPVisionConfig()) == {}  # the class's own tower
    # geometry only: the image size is the tiny model's to fit
    assert "image_size" not in composite_tower_values(transformers.LlavaNextConfig().vision_config)


def test_a_placeholder_spelled_out_per_feature_renders_as_a_repetition():
    from mmrl.scaffold.render import _text_expression

    assert _text_expression("<image>" * 256) == '"<image>" * 256'
    assert _text_expression("<|vision_start|><|image_pad|><|vision_end|>") == '"<|vision_start|><|image_pad|><|vision_end|>"'
    assert _text_expression("<image>") == '"<image>"' and _text_expression("") == '""'
    assert eval(_text_expression("<image>" * 256)) == "<image>" * 256  # noqa: S307 - our own literal


def test_an_unset_router_top_k_gets_a_tiny_value():
    from mmrl.scaffold.shrink import tiny_text_values

    # DeepseekV2Config leaves num_experts_per_tok None; its router passes it to torch.topk.
    assert tiny_text_values("DeepseekV2Config")["num_experts_per_tok"] == 2


def test_sweep_refuses_a_type_list_it_would_half_read(tmp_path):
    """`--types a b` leaves b as MODEL_TYPE, which a sweep would ignore (only a swept): it
    fails in one line that names the right spelling, and no coverage file is written."""
    coverage = tmp_path / "coverage.json"
    result = add_model("--sweep", "--types", "llama", "qwen2", "--coverage", str(coverage), "--no-progress")
    assert result.exit_code != 0
    assert "--types qwen2,OTHER_TYPE" in result.output and "MODEL_TYPE" in result.output
    assert not coverage.exists()


def test_a_model_without_a_vision_tower_reads_images_through_its_patch_embedders():
    """No sibling of the language model holds a block stack at any level (patches are
    projected straight into the decoder): those nearest siblings are the vision part, with
    their linear leaves for LoRA and no vision blocks to shard; a model with a tower keeps
    the tower and its projector."""
    import torch

    from mmrl.scaffold.discover import _vision_parts

    def language():
        return torch.nn.ModuleDict({"embed_tokens": torch.nn.Embedding(10, 8),
                                    "layers": torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])})

    towerless = torch.nn.ModuleDict({
        "model": torch.nn.ModuleDict({"language_model": language(), "patch_embed": torch.nn.Linear(12, 8),
                                      "embedder": torch.nn.ModuleDict({"proj": torch.nn.Linear(8, 8)})}),
        "lm_head": torch.nn.Linear(8, 10)})
    fill_in: list[str] = []
    vision, projector, block, leaves = _vision_parts(towerless, "model.language_model", 8, None, fill_in)
    assert vision == ("model.patch_embed", "model.embedder") and projector == () and block is None
    assert leaves == ("patch_embed", "proj") and fill_in == []

    towered = torch.nn.ModuleDict({
        "model": torch.nn.ModuleDict({"language_model": language(), "projector": torch.nn.Linear(4, 8),
                                      "tower": torch.nn.ModuleDict({"blocks": torch.nn.ModuleList(
                                          [torch.nn.Linear(4, 4) for _ in range(2)])})}),
        "lm_head": torch.nn.Linear(8, 10)})
    vision, projector, block, _ = _vision_parts(towered, "model.language_model", 8, None, fill_in)
    assert vision == ("model.tower",) and projector == ("model.projector",) and block == "Linear"


def test_a_stack_left_all_linear_attention_gets_one_attention_layer_as_a_last_try():
    """Hybrids whose default config holds no attention layer: the per-layer kinds (or an
    unset list of attention-layer indexes) name the last tiny layer attention, only when
    asked (the scaffold's last candidate); a pure state-space config is left as it is."""
    from mmrl.scaffold.shrink import tiny_text_values
    from mmrl.scaffold.tiny_inputs import tiny_model_inputs
    from mmrl.scaffold.resolve import resolve

    assert "layer_types" not in tiny_text_values("GraniteMoeHybridConfig") or set(
        tiny_text_values("GraniteMoeHybridConfig")["layer_types"]) == {"linear_attention"}
    assert tiny_text_values("GraniteMoeHybridConfig", attend_last=True)["layer_types"] == [
        "linear_attention", "full_attention"]
    assert tiny_text_values("BambaConfig", attend_last=True)["attn_layer_indices"] == [1]
    assert "attn_layer_indices" not in tiny_text_values("BambaConfig")
    tiny = tiny_model_inputs(resolve("bamba"))  # the earlier candidates fail in the cache; this one runs
    assert tiny.config.layers_block_type == ["linear_attention", "full_attention"]


def test_a_default_listing_no_stateful_layer_gets_the_kinds_the_model_code_keys():
    """Lfm2's default config is all attention, while its model code keys short
    convolutions ("conv") and its checkpoints interleave them: the tiny config gets one
    layer of each kind (its attention-index list follows), so the padding-free boundary
    case and sequence parallelism run on a conv layer; lists that name a stateful kind
    or only stateless ones the code keys are left as they were."""
    from mmrl.scaffold.shrink import tiny_text_values

    lfm2 = tiny_text_values("Lfm2Config")
    assert lfm2["layer_types"] == ["conv", "full_attention"] and lfm2["num_hidden_layers"] == 2
    assert lfm2["full_attn_idxs"] == [1]
    assert tiny_text_values("Lfm2MoeConfig")["layer_types"] == ["conv", "full_attention"]  # left None: as before
    assert tiny_text_values("Gemma3TextConfig")["layer_types"] == ["sliding_attention", "full_attention"]
    assert "layer_types" not in tiny_text_values("LlamaConfig")


def test_a_packed_boundary_failure_says_why_no_position_ids_fix_it():
    """The padding_free gap of a decoder whose state crosses a packed boundary names the
    stateful layers and keeps padding_free=False, instead of the positions advice."""
    import transformers

    from mmrl.scaffold.depth import TO_WRITE, to_write

    cause = ("state crosses a packed sequence boundary (a short sample behind a long neighbour differs from itself "
             "alone by log-prob 1.6e-04 (tolerance 1e-05), last hidden state 4.1e-03 (tolerance 1e-04))")
    config = transformers.Lfm2Config(num_hidden_layers=2, layer_types=["conv", "full_attention"])
    line = to_write("padding_free", cause, config)
    assert line.startswith("keep padding_free=False: the decoder has layers that carry a state along the sequence "
                           "(conv)") and "model.pack: true" in line
    assert "(linear_attention)" in to_write("padding_free", cause, transformers.Qwen3NextConfig())
    assert to_write("padding_free", "packed and padded logits differ by 0.3") == TO_WRITE["padding_free"]
    # stopped before the boundary case (positions), on a decoder with stateful layers: both said
    positions = "ValueError: packing needs the adapter's position ids (the model would count positions across sequences)"
    line = to_write("padding_free", positions, transformers.Qwen3NextConfig())
    assert line.startswith(TO_WRITE["padding_free"]) and "(linear_attention)" in line and line.endswith("padding_free=False")
    # no stateful layers (positions counted from the row's start leak instead): the positions advice
    assert to_write("padding_free", cause, transformers.OPTConfig()) == TO_WRITE["padding_free"]


def test_state_space_head_groups_shrink_with_the_heads():
    from mmrl.scaffold.shrink import tiny_text_values

    # NemotronH's 8 head groups over 2 tiny heads left 0 heads per group (repeat_interleave).
    values = tiny_text_values("NemotronHConfig")
    assert values["mamba_num_heads"] % values["n_groups"] == 0 and values["n_groups"] == 1


def test_a_count_of_some_layers_keeps_its_share_of_the_shrunk_depth():
    from mmrl.scaffold.shrink import tiny_text_values

    # Gemma3n: the last 15 of 35 layers share key/value caches; 4 tiny layers keep 2
    # (15 left none unshared, and the model looks one up by kind).
    values = tiny_text_values("Gemma3nTextConfig")
    assert values["num_hidden_layers"] == 4 and values["num_kv_shared_layers"] == 2
    assert "num_nextn_predict_layers" not in tiny_text_values("DeepseekV3Config")  # 1 stays 1, unwritten


def test_a_causal_lm_built_from_the_text_sub_config_is_scaffolded_on_that_config():
    """A composite type whose causal-LM class declares its text sub-config's class (as
    `AutoModelForCausalLM.from_config` reads it) is shrunk and built on that class; a type
    whose causal LM takes its own config keeps it."""
    from mmrl.scaffold.resolve import resolve

    # Emu3's causal LM is its text model alone; Emu3Config itself has no text shape fields.
    assert resolve("emu3").config_class == "Emu3TextConfig" and not resolve("emu3").is_vision_language
    assert resolve("llama").config_class == "LlamaConfig"


def test_expert_counts_left_unset_by_default_get_tiny_values_as_a_later_try():
    """A default config that leaves its expert counts None (checkpoints write them) gets
    tiny ones, only when asked (after the default's own None failed: None can also mean
    a dense model)."""
    from mmrl.scaffold.resolve import resolve
    from mmrl.scaffold.shrink import tiny_text_values
    from mmrl.scaffold.tiny_inputs import tiny_model_inputs

    # Dots1Config leaves n_routed_experts and n_shared_experts None; its experts are sized by them.
    assert "n_routed_experts" not in tiny_text_values("Dots1Config")
    values = tiny_text_values("Dots1Config", unset_experts=True)
    assert values["n_routed_experts"] == 4 and values["n_shared_experts"] == 1
    tiny = tiny_model_inputs(resolve("dots1"))  # the earlier candidates fail at torch.empty(None, ...)
    assert tiny.config.n_routed_experts == 4


def test_fields_a_validator_relates_are_related_again_after_shrinking():
    """Where the class's validation rejects the shrunk values, the integer fields its
    message names keep the relation the default config gives them, by changing a field
    left at its default: a product (hidden width x expansion = heads x per-head width)
    solved for the head count, a divisor cut to one of the shrunk value."""
    import transformers

    from mmrl.scaffold.shrink import tiny_text_values

    values = tiny_text_values("Mamba2Config")
    assert values["hidden_size"] * transformers.Mamba2Config().expand == values["num_heads"] * values["head_dim"]
    assert values["num_heads"] < transformers.Mamba2Config().num_heads
    transformers.Mamba2Config(**values)  # accepted

    values = tiny_text_values("Glm5NextTextConfig")  # index_topk 2048 over pools of 16, shrunk to 2
    assert values["index_topk"] % values["index_kpool"] == 0
    transformers.Glm5NextTextConfig(**values)
    assert "num_heads" not in tiny_text_values("LlamaConfig")  # an accepted config is left as it is


def test_layer_kinds_left_unset_are_read_off_the_model_codes_mask_mapping():
    """A default config that leaves `layer_types` None, under model code that keys its
    attention masks by layer kind: one layer of each kind, attention last; a default that
    sets its own list is left to the per-layer shrink, unless the list lacks every stateful
    kind the code keys (Lfm2: below and in the test after the linear-attention one)."""
    import transformers

    from mmrl.scaffold.shrink import _unset_layer_kinds, tiny_text_values

    # Lfm2MoeConfig leaves layer_types None; its model indexes it per layer, and
    # {"full_attention": ..., "conv": ...} names the kinds.
    values = tiny_text_values("Lfm2MoeConfig")
    assert values["layer_types"] == ["conv", "full_attention"] and values["num_hidden_layers"] == 2
    assert _unset_layer_kinds(transformers.Gemma3TextConfig, transformers.Gemma3TextConfig(), {}, {}) == {}
    assert _unset_layer_kinds(transformers.Lfm2Config, transformers.Lfm2Config(), {}, {})["layer_types"] == [
        "conv", "full_attention"]


def test_fields_the_class_derives_are_left_to_it_as_a_later_try():
    """Fields whose class default is None but that the default config holds (the class
    derived them) are left out, only when asked: each shrunk on its own by name, they can
    break the sum the class keeps (query/key width = plain + rotary part)."""
    from mmrl.scaffold.resolve import resolve
    from mmrl.scaffold.shrink import tiny_text_values
    from mmrl.scaffold.tiny_inputs import tiny_model_inputs

    assert tiny_text_values("LongcatFlashConfig")["qk_head_dim"] == 32  # 32 + 32 by its parts
    assert "qk_head_dim" not in tiny_text_values("LongcatFlashConfig", derived=True)
    tiny = tiny_model_inputs(resolve("longcat_flash"))  # the earlier candidates fail in torch.split
    assert tiny.config.qk_head_dim == tiny.config.qk_nope_head_dim + tiny.config.qk_rope_head_dim
    # Never a sub-config left None: the class would build it at its full size (BLT's four
    # sub-configs, whose model at their defaults took the sweep's process out of memory).
    derived = tiny_text_values("BltConfig", derived=True)
    assert derived["global_config"]["hidden_size"] == tiny_text_values("BltConfig")["global_config"]["hidden_size"]


def test_scaffold_gives_sizes_left_unset_that_the_model_reads_tiny_values_as_a_later_try():
    """Integer fields a default config leaves None while its model code builds the part
    they size (released checkpoints write them: Qwen4-Exp's QSA indexer) get tiny values,
    only when asked (None can also mean "off"); a text type reaches them as its last
    candidate, a vision-language type where its tiny model does not build without them.
    Token ids and windows stay unset."""
    import transformers

    from mmrl.scaffold.resolve import resolve
    from mmrl.scaffold.shrink import build_tiny, tiny_text_values
    from mmrl.scaffold.tiny_inputs import tiny_model_inputs

    assert "indexer_budget" not in tiny_text_values("Qwen4ExpTextConfig")
    values = tiny_text_values("Qwen4ExpTextConfig", unset_sizes=True)
    assert values["indexer_head_dim"] == 32 and values["indexer_budget"] == values["indexer_kv_heads"] == 1
    assert not {"pad_token_id", "bos_token_id", "eos_token_id"} & set(values)
    transformers.Qwen4ExpTextConfig(**values)  # the class's own validation accepts them
    assert "sliding_window" not in tiny_text_values("MistralConfig", unset_sizes=True)
    tiny = tiny_model_inputs(resolve("qwen4_exp_text"))  # every earlier candidate fails at None // None
    assert tiny.config.indexer_budget == 1
    resolved = resolve("qwen4_exp")
    tiny = tiny_model_inputs(resolved)
    assert tiny.media.text_overrides["indexer_budget"] == 1
    build_tiny(resolved.model_class, tiny.config)


def test_scaffold_stops_at_a_package_the_vision_language_model_needs(monkeypatch):
    """A tiny model that cannot be built for a package not installed (a timm tower) stops
    the config stage with that cause, before the placeholder search runs the model and
    names another (FastVLM's processor divided by the patch size of a tower timm would
    have said); any other build failure goes on to the later stages."""
    from mmrl.scaffold import media
    from mmrl.scaffold.base import ScaffoldError
    from mmrl.scaffold.resolve import resolve

    def missing(model_class, config):
        raise ScaffoldError(f"{model_class} cannot be built") from ImportError("TimmWrapperModel requires timm")

    monkeypatch.setattr(media, "build_tiny", missing)
    with pytest.raises(ScaffoldError) as caught:
        media.tiny_vision_language(resolve("llava"))
    assert isinstance(caught.value.__cause__, ImportError)

    def broken(model_class, config):
        raise ScaffoldError(f"{model_class} cannot be built") from TypeError("None // None")

    monkeypatch.setattr(media, "build_tiny", broken)
    assert media.tiny_vision_language(resolve("llava")).media.image_placeholder


def test_scaffold_builds_the_text_config_of_the_composites_own_text_config_class():
    """A composite whose default text config is a generic one (Granite 4 Vision's: a
    Llama config) while its text model reads fields of the package's own text config
    class (`attention_multiplier`) is shrunk on that class: the one config class of the
    package that declares itself the text sub-config. A package without one (LLaVA)
    keeps the default's class."""
    import transformers

    from mmrl.scaffold.media import _text_config_class
    from mmrl.scaffold.resolve import resolve
    from mmrl.scaffold.tiny_inputs import tiny_model_inputs

    chosen = _text_config_class(transformers.Granite4VisionConfig, "text_config", transformers.LlamaConfig())
    assert chosen is transformers.Granite4VisionTextConfig
    assert _text_config_class(transformers.LlavaConfig, "text_config", transformers.LlamaConfig()) is (
        transformers.LlamaConfig)
    assert _text_config_class(transformers.Qwen2VLConfig, "text_config",
                              transformers.Qwen2VLTextConfig()) is transformers.Qwen2VLTextConfig
    tiny = tiny_model_inputs(resolve("granite4_vision"))
    assert tiny.media.text_config_class == "Granite4VisionTextConfig"
    assert tiny.config.text_config.attention_multiplier == 1.0


def test_a_composite_that_is_its_own_text_config_holds_its_tower_inside_the_text_module():
    """A config whose own fields configure the text model (no text sub-config, a vision
    sub-config) is shrunk at its top level, and the model's one module holding the text
    stack also holds the tower: the module built from the vision sub-config is vision,
    its siblings a text-only forward does not run are the projector (none where the model
    cannot run without an image)."""
    from mmrl.scaffold import quiet_transformers
    from mmrl.scaffold.discover import _vision_parts
    from mmrl.scaffold.resolve import resolve
    from mmrl.scaffold.shrink import build_tiny
    from mmrl.scaffold.tiny_inputs import tiny_model_inputs

    expected = {"git": ("git", ("git.image_encoder",), ("git.visual_projection",)),
                "idefics": ("model", ("model.vision_model",), ())}  # Idefics needs an image in every pass
    for model_type, (language, vision, projector) in expected.items():
        resolved = resolve(model_type)
        with quiet_transformers():
            tiny = tiny_model_inputs(resolved)
        assert tiny.media.top_text_key is None and tiny.config.get_text_config(decoder=True) is tiny.config
        assert tiny.config.hidden_size == 64 and tiny.config.num_hidden_layers == 2
        model = build_tiny(resolved.model_class, tiny.config)
        fill_in: list[str] = []
        found = _vision_parts(model, language, 64, tiny.config.vision_config, fill_in)
        assert found[:2] == (vision, projector) and found[2] is not None and fill_in == []


def test_a_text_scaffold_declares_the_unrun_modules_beside_its_nested_language_model_as_vision():
    """A multimodal model scaffolded as a text family (Fuyu: its causal-LM class is its
    image-text class) holds modules beside its nested language model, in no part: those a
    text-only forward does not run read images (a patch embedding) and are its vision
    part; one the text path runs is not."""
    import torch

    from mmrl.adapter import Parts
    from mmrl.scaffold.discover import _image_input_beside

    class Nested(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.ModuleDict({
                "language_model": torch.nn.ModuleDict({"embed_tokens": torch.nn.Embedding(10, 8),
                                                       "layers": torch.nn.ModuleList([torch.nn.Linear(8, 8)])}),
                "patch_embed": torch.nn.Linear(12, 8), "final_norm": torch.nn.LayerNorm(8)})
            self.lm_head = torch.nn.Linear(8, 10)

        def get_input_embeddings(self):
            return self.model["language_model"]["embed_tokens"]

        def forward(self, input_ids):
            hidden = self.get_input_embeddings()(input_ids)
            for layer in self.model["language_model"]["layers"]:
                hidden = layer(hidden)
            return self.lm_head(self.model["final_norm"](hidden))

    parts = Parts(language="model.language_model", embed="model.language_model.embed_tokens", lm_head="lm_head")
    assert _image_input_beside(Nested(), "model.language_model", parts) == ("model.patch_embed",)


def test_a_sub_processor_that_cannot_save_has_the_switches_its_error_names_turned_off():
    """Ernie 4.5 VL's video processor draws timestamps with a font file its checkpoints
    ship; offline it cannot be saved and its error says "disable `draw_on_frames`": the
    switch is turned off (it then saves). A processor that saves keeps its defaults."""
    import transformers

    from mmrl.scaffold.media import _switches_off_to_save

    assert _switches_off_to_save(transformers.Ernie4_5_VLMoeVideoProcessor, {}) == {"draw_on_frames": False}
    assert _switches_off_to_save(transformers.Qwen2VLImageProcessor, {}) == {}


def test_a_shape_property_whose_setter_refuses_is_not_set():
    """XLNet has no length limit: its config reads `max_position_embeddings` as -1 through
    a property whose setter raises, so the shrink leaves it out (before, setting the tiny
    1024 made the config refuse). A property that takes its own value back is still set."""
    import transformers

    from mmrl.scaffold.shrink import _read_only, tiny_text_values

    assert _read_only(transformers.XLNetConfig(), "max_position_embeddings")
    values = tiny_text_values("XLNetConfig")
    assert "max_position_embeddings" not in values and values["d_model"] == 64
    transformers.XLNetConfig(**values)
    assert not _read_only(transformers.NemotronHConfig(), "num_hidden_layers")  # a setter that accepts


def test_layers_reused_over_cycles_are_found_by_the_configs_per_stack_count():
    """HRM loops two stacks of layers over cycles: its config rewrites num_hidden_layers
    to the passes its cache holds (2 per stack x 2 x (3 + 1) = 16), and no list holds 16
    layers; the stack is then found by the config's other layer count (num_layers_per_stack).
    A config whose depth names a list is read as before."""
    import transformers

    from scaffold_setup import discovered

    from mmrl.scaffold.discover import _other_layer_counts

    config = transformers.HrmTextConfig(num_hidden_layers=2)
    assert config.num_hidden_layers == 16 and _other_layer_counts(config) == [2]
    found = discovered("hrm_text", "hrm_text")
    assert found.parts.language == ("model",) and found.decoder_layers == ("HrmTextDecoderLayer",)
    assert found.fill_in == []


def test_a_composite_whose_validator_ties_a_tower_field_to_its_own_gets_them_equal():
    """A composite config that holds a field both itself and in its tower, equal in its
    default (Nemotron-H Omni's `video_temporal_patch_size`, which its validator wants equal),
    gets the tower's copy set to its own when the shrunk tower lost it."""
    import transformers

    from mmrl.scaffold.media_plan import _shared_values_kept

    config_cls = getattr(transformers, "NemotronH_Omni_Reasoning_V3_Config", None)
    if config_cls is None:
        pytest.skip("this transformers has no Nemotron-H Omni")
    vision = config_cls().vision_config.to_dict()
    vision["video_temporal_patch_size"] = None  # as a tower rebuilt from its own class's defaults has it
    with pytest.raises(Exception, match="video_temporal_patch_size"):
        config_cls(vision_config=vision)
    kept = _shared_values_kept(config_cls, "vision_config", {"vision_config": vision})
    assert kept["vision_config"]["video_temporal_patch_size"] == 2
    assert config_cls(**kept).vision_config.video_temporal_patch_size == 2
    assert _shared_values_kept(config_cls, "vision_config", kept) is None  # nothing left to set


def test_a_depth_probe_that_fails_leaves_its_capability_undeclared_with_why(tmp_path, monkeypatch):
    """The depth stage runs the probes beyond the quick checks through the probe table
    and declares what verified; a failing one (here sequence_parallel, made to fail) is
    left out, and the adapter, the notes and the result name the column, the cause and
    what to write by hand."""
    import mmrl.probes
    from mmrl.probes import ProbeResult, Status
    from mmrl.scaffold import scaffold

    real = mmrl.probes.probe
    ran = []

    def probe(feature):
        ran.append(feature)
        if feature != "sequence_parallel":
            return real(feature)

        class Failing:
            def run(self, subject):
                assert type(subject.adapter).__module__.startswith("_mmrl_depth_adapter_")
                assert subject.adapter.capabilities.sequence_parallel  # the candidate is claimed while probed
                return ProbeResult(Status.FAILED, "log-probs differ by 3e-02 (made to fail)")
        return Failing()

    monkeypatch.setattr(mmrl.probes, "probe", probe)
    # The vllm column's probe process is stood in for (tests/test_scaffold_vllm.py tests that column).
    monkeypatch.setattr("mmrl.probes.isolated.run_isolated",
                        lambda name, subject, seconds: ProbeResult(Status.VERIFIED, "stood in"))
    result = scaffold(TEXT_TYPE, out=tmp_path)
    # a text type: no video, no multi_turn; a failed Ulysses probe runs again with gathered mixers
    assert ran == ["sequence_parallel", "sequence_parallel"]
    assert not result.capabilities.sequence_parallel and result.capabilities.padding_free
    assert "sequence_parallel" in result.decided and "multi_turn" not in result.decided
    [gap] = [g for g in result.gaps if g.column == "sequence_parallel"]
    assert "made to fail" in gap.cause and "SequenceParallel" in gap.write
    assert any(n.startswith("sequence_parallel not declared: log-probs differ") for n in result.notes)
    source = (tmp_path / f"mmrl_{TEXT_TYPE}" / f"{TEXT_TYPE}.py").read_text()
    assert "# Not declared: sequence_parallel (log-probs differ" in source
    assert "sequence_parallel=True" not in source
    assert result.sequence_parallel_mode == "", "no mode where sequence_parallel is not declared"


def test_the_coverage_page_shows_depth_per_type_and_old_rows_run_again(tmp_path):
    """coverage.json's rows carry a column per capability; the page counts each column's
    green types per table, marks every type's cells and lists the gaps; a row recorded
    before the columns existed is not current (the sweep runs it again)."""
    from mmrl.scaffold import COLUMNS
    from mmrl.scaffold.sweep import Row, is_current, write_document

    columns = {c: "yes" for c in COLUMNS} | {"multi_turn": "no", "video": "n/a"}
    gap = {"column": "multi_turn", "cause": "the opening turn is processed into other tokens", "write": "fix it"}
    rows = {
        "new": Row("new", "image_text_to_text", True, "green", "tests", "",
                   capabilities=[c for c, v in columns.items() if v == "yes"], columns=columns, gaps=[gap],
                   sequence_parallel_mode="ulysses"),
        "old": Row("old", "image_text_to_text", True, "green", "tests", "", capabilities=["generation", "single_image"]),
        "lm": Row("lm", "causal_lm", True, "green", "tests", "", capabilities=["generation", "sequence_parallel"],
                  columns={c: "n/a" for c in COLUMNS} | {"generation": "yes", "sequence_parallel": "yes"},
                  sequence_parallel_mode="gathered"),
        "broken": Row("broken", "causal_lm", True, "model-init", "model", "it broke"),
    }
    assert [is_current(r) for r in rows.values()] == [True, False, True, True]
    document = write_document(tmp_path / "coverage.json", rows, "5.19.0")
    vlm = document["summary"]["image_text_to_text"]
    assert vlm["declared"]["single_image"] == 2 and vlm["declared"]["multi_turn"] == 0
    assert vlm["green_with_columns"] == 1
    assert document["summary"]["causal_lm"]["declared"]["sequence_parallel"] == 1
    page = (tmp_path / "coverage.md").read_text()
    assert "| `sequence_parallel` | 1 of 1 (100%) | 1 of 2 (50%) |" in page
    assert "| `multi_turn` | 0 of 1 (0%) | 0 of 2 (0%) |" in page
    new = next(line for line in page.splitlines() if line.startswith("| `new` |"))
    assert new.count("✓") == len(COLUMNS) - 2 and "✗" in new and "–" in new
    assert "- `new` **multi_turn**: the opening turn is processed into other tokens; to claim it, fix it." in page
    assert "it broke" in next(line for line in page.splitlines() if line.startswith("| `broken` |"))
    # the SP cell names the mode that verified and the adapter declares
    assert "| ✓ gathered |" in next(line for line in page.splitlines() if line.startswith("| `lm` |"))
    assert "| ✓ ulysses |" in new
    assert document["summary"]["causal_lm"]["sequence_parallel_modes"] == {"gathered": 1}
    assert vlm["sequence_parallel_modes"] == {"ulysses": 1}
    assert "causal_lm 1 gathered; image_text_to_text 1 ulysses." in page
    # a row declaring it without the mode (recorded before the mode was) is run again
    assert not is_current(dataclasses.replace(rows["lm"], sequence_parallel_mode=""))


def test_a_scale_equal_to_a_default_width_is_not_taken_for_one():
    from mmrl.scaffold.shrink import tiny_text_values

    # Llama 4's floor_scale (8192, its default intermediate width) divides positions in the
    # attention's temperature tuning; shrunk to 128 it stepped inside the padded-batch check.
    values = tiny_text_values("Llama4TextConfig")
    assert "floor_scale" not in values and values["intermediate_size"] < 8192


def test_lora_targets_leave_out_a_linear_layer_whose_forward_returns_no_tensor():
    import torch
    import transformers
    from transformers.models.falcon.modeling_falcon import FalconLinear
    from transformers.models.llama4.modeling_llama4 import Llama4Router

    from mmrl.scaffold.discover import _linear_leaves

    # Llama 4's router is an nn.Linear whose forward gives (scores, logits): LoRA adds its
    # product to the wrapped layer's output. Falcon's own Linear returns a tensor and stays.
    config = transformers.Llama4TextConfig(hidden_size=16, num_local_experts=4, intermediate_size=32)
    block = torch.nn.ModuleDict({"router": Llama4Router(config), "dense": FalconLinear(16, 16),
                                 "q_proj": torch.nn.Linear(16, 16)})
    assert _linear_leaves(block) == ("dense", "q_proj")


def test_scaffold_rekeys_a_map_of_patch_counts_to_the_tiny_towers_count():
    """AriaConfig maps patches per image to projector queries for the checkpoint's patch
    size only ({1225: 128, 4900: 256}); the tiny tower cuts its image into another count.
    The map is re-keyed to that count (the value that runs kept) and written as int keys."""
    import transformers

    from mmrl.scaffold import quiet_transformers
    from mmrl.scaffold.image_size import patch_count_maps
    from mmrl.scaffold.media_plan import build_config, build_processor, runs_with_image
    from mmrl.scaffold.render import _literal_dict
    from mmrl.scaffold.resolve import resolve
    from mmrl.scaffold.tiny_inputs import tiny_model_inputs

    assert patch_count_maps(transformers.AriaConfig()) == {"projector_patch_to_query_dict": {1225: 128, 4900: 256}}
    assert patch_count_maps(transformers.LlavaConfig()) == {}
    resolved = resolve("aria")
    with quiet_transformers():
        tiny = tiny_model_inputs(resolved)
        plan = tiny.media
        counts = plan.top["projector_patch_to_query_dict"]
        assert len(counts) == 1 and next(iter(counts)) not in (1225, 4900)
        tokenizer, config = build_config(resolved, plan)
        processor = build_processor(plan, tokenizer, config)
        assert runs_with_image(resolved.model_class, config, processor, plan.image_placeholder) is None
    assert _literal_dict({"map": counts}) == "{" + f'"map": {{{next(iter(counts))}: {counts[next(iter(counts))]}}}' + "}"


def test_scaffold_lines_up_the_logits_of_a_model_that_prepends_positions():
    """GIT prepends its image features to the text: its logits run longer than input_ids.
    The scaffold finds that by running the tiny model and declares prepends_positions;
    the adapter's on_load then keeps the last input_ids.shape[1] positions (shorter
    outputs, as with logits_to_keep, stay as they are)."""
    import torch
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from scaffold_setup import discovered

    from mmrl.adapter import ModelAdapter

    class Prepending(torch.nn.Module):
        def forward(self, input_ids, keep=0):
            length = 3 + input_ids.shape[1]  # three image positions in front
            hidden = torch.arange(length, dtype=torch.float).view(1, length, 1)
            return CausalLMOutputWithPast(logits=hidden[:, -keep:] if keep else hidden, hidden_states=(hidden,))

    class Declares(ModelAdapter):
        prepends_positions = True

    ids = torch.zeros(1, 4, dtype=torch.long)
    assert Prepending()(ids).logits.shape[1] == 7
    model = Declares().on_load(Prepending())
    out = model(input_ids=ids)
    assert out.logits.flatten().tolist() == [3, 4, 5, 6] and out.hidden_states[0].shape[1] == 4
    assert model(ids, keep=2).logits.flatten().tolist() == [5, 6]
    assert ModelAdapter.prepends_positions is False

    assert discovered("git", "git").prepends_positions
    # llava places its image features at the placeholder tokens
    assert not discovered("llava", "llava_scaffold").prepends_positions


def test_scaffold_per_layer_kinds_left_unset_are_read_off_the_model_code():
    """DeepseekOcr2TextConfig leaves `mlp_layer_types` None, while its decoder layer reads
    `config.mlp_layer_types[layer_idx] == "sparse"`: with the sizes left unset, the list gets
    one layer of each kind its docstring names (dense first), and the text model builds."""
    import torch
    import transformers

    from mmrl.scaffold.shrink import _unset_per_layer_kinds, tiny_text_values
    from mmrl.tiny import TINY_TEXT_SHAPES

    values = tiny_text_values("DeepseekOcr2TextConfig", unset_sizes=True)
    assert values["mlp_layer_types"] == ["dense", "sparse"]
    assert values["num_hidden_layers"] == max(2, TINY_TEXT_SHAPES["num_hidden_layers"])
    assert "mlp_layer_types" not in tiny_text_values("DeepseekOcr2TextConfig")  # tried only after None failed
    with torch.random.fork_rng(devices=[]):
        model = transformers.DeepseekOcr2TextModel(transformers.DeepseekOcr2TextConfig(**values))
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["DeepseekOcr2TextMLP", "DeepseekOcr2TextMoe"]
    # A list the default config fills in itself is left to the per-layer shrink.
    assert _unset_per_layer_kinds(transformers.LagunaConfig, transformers.LagunaConfig(), {}, TINY_TEXT_SHAPES) == {}
    # One kind known only (Lfm2-MoE compares `layer_types[i] == "full_attention"`, its convolutions
    # go unnamed): no list that would drop the others.
    assert _unset_per_layer_kinds(transformers.Lfm2MoeConfig, transformers.Lfm2MoeConfig(), {}, TINY_TEXT_SHAPES) == {}


def test_scaffold_a_default_width_concatenated_with_the_tiny_one_is_fitted(monkeypatch):
    """A concatenation error ("Expected size 896 but got size 64"): the one vision field of
    either width left at its default, here an entry of a sub-config's list of channel widths
    (DeepSeek-OCR-2's SAM `downsample_channels`), takes the other width."""
    from types import SimpleNamespace

    from mmrl.scaffold import image_size

    sam = {"model_type": "sam", "hidden_size": 768, "downsample_channels": [512, 896]}
    defaults = {"model_type": "tower", "sam_config": sam, "encoder_config": {"model_type": "enc", "hidden_size": 4096}}

    def merged(base, over):
        return {k: merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
                for k, v in {**base, **over}.items()}

    def built(resolved, plan):
        return "tokenizer", SimpleNamespace(vision_config=SimpleNamespace(to_dict=lambda: merged(defaults, plan.vision)))

    def run(model_class, config, processor, placeholder, text_kwargs):
        vision = config.vision_config.to_dict()
        channels, width = vision["sam_config"]["downsample_channels"][-1], vision["encoder_config"]["hidden_size"]
        return None if channels == width else (
            f"RuntimeError: Sizes of tensors must match except in dimension 1. Expected size {channels} but got size "
            f"{width} for tensor number 1 in the list.")

    monkeypatch.setattr(image_size, "build_config", built)
    monkeypatch.setattr(image_size, "build_processor", lambda plan, tokenizer, config: "processor")
    monkeypatch.setattr(image_size, "runs_with_image", run)
    shrunk = {"sam_config": {"model_type": "sam", "hidden_size": 32}, "encoder_config": {"model_type": "enc",
                                                                                       "hidden_size": 64}}
    plan = SimpleNamespace(vision=dict(shrunk), vision_key="vision_config", image_placeholder="<image>",
                           text_kwargs=None)
    _, config = built(None, plan)
    fitted = image_size._input_widths_fitted(SimpleNamespace(model_class="M"), plan, config, run("M", config, 0, 0, 0))
    assert fitted is not None and fitted[1] is None
    assert plan.vision["sam_config"] == {"model_type": "sam", "hidden_size": 32, "downsample_channels": [512, 64]}
    assert plan.vision["encoder_config"] == shrunk["encoder_config"]


def test_scaffold_processor_tokens_held_as_class_constants_are_found():
    """MiniMaxM3VLProcessor spells its tokens as class constants (`IMAGE_TOKEN = "]<]image[>["`,
    read as `self.image_token = self.IMAGE_TOKEN`), none in angle brackets: they are named by
    the constant, so the tiny tokenizer holds them and the image placeholder is found (framed
    by the processor itself, so written alone)."""
    import transformers

    from mmrl.scaffold import quiet_transformers
    from mmrl.scaffold.placeholders import tokens_in_source
    from mmrl.scaffold.resolve import resolve
    from mmrl.scaffold.tiny_inputs import tiny_model_inputs

    named, _, _ = tokens_in_source(transformers.MiniMaxM3VLProcessor)
    assert named["image_token"] == "]<]image[>[" and named["video_token"] == "]<]video[>["
    assert named["vision_start_token"] == "]<]start of image[>[" and named["vision_end_token"] == "]<]end of image[>["
    with quiet_transformers():
        plan = tiny_model_inputs(resolve("minimax_m3_vl")).media
    assert plan.image_placeholder == "]<]image[>["
    assert plan.token_fields["image_token_index"] == "]<]image[>[" and plan.video_placeholder == "]<]video[>["


def test_scaffold_an_audio_sub_processor_is_the_one_of_the_audio_encoder_the_config_builds(monkeypatch):
    """Nemotron-H Omni's processor requires a `feature_extractor`; transformers' table has no
    entry for the type, but its configuration module builds a Parakeet encoder by name
    (`CONFIG_MAPPING["parakeet_encoder"]`), whose table entry is ParakeetFeatureExtractor.
    Where the class needs a package not installed (librosa), the scaffold says so."""
    import importlib.util

    import transformers

    from mmrl.scaffold import ScaffoldError, quiet_transformers
    from mmrl.scaffold.media import _sub_config_types
    from mmrl.scaffold.resolve import resolve
    from mmrl.scaffold.tiny_inputs import tiny_model_inputs

    assert "parakeet_encoder" in _sub_config_types(transformers.NemotronH_Omni_Reasoning_V3_Config())
    try:
        with quiet_transformers():
            tiny = tiny_model_inputs(resolve("nemotron_h_omni"))
    except ScaffoldError as exc:
        assert importlib.util.find_spec("librosa") is None, exc
        assert str(exc).startswith("ParakeetFeatureExtractor needs a package not installed here"), exc
        assert "librosa" in str(exc) and exc.category == "processor"
    else:
        assert tiny.media.sub_processors["feature_extractor"][0] == "ParakeetFeatureExtractor"


def test_scaffold_a_model_nesting_a_whole_causal_lm_takes_its_head():
    """A class that declares no output embeddings of its own because it nests a whole causal
    LM (Nemotron-H Omni's `language_model = AutoModelForCausalLM.from_config(...)`): the
    nested model's head is read as the lm_head part, and the adapter's on_load gives the
    model that head (mmrl's log-prob head reads `model.get_output_embeddings()`)."""
    import dataclasses

    import torch
    import transformers

    from scaffold_setup import discovered, rendered

    from mmrl.scaffold.discover import _output_embeddings

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=40)

    class Nesting(transformers.PreTrainedModel):
        config_class = transformers.LlamaConfig

        def __init__(self, config):
            super().__init__(config)
            self.language_model = transformers.LlamaForCausalLM(config)

    with torch.random.fork_rng(devices=[]):
        nesting, plain = Nesting(config), transformers.LlamaForCausalLM(config)
    assert nesting.get_output_embeddings() is None
    assert _output_embeddings(nesting) == (nesting.language_model.lm_head, "language_model")
    assert _output_embeddings(plain) == (plain.lm_head, "")
    found = discovered("llama", "llama_scaffold")
    assert found.nested_head == ""
    assert "def on_load" not in rendered(found, capabilities=False)
    nested = dataclasses.replace(found, nested_head="language_model")
    source = rendered(nested, capabilities=False)
    assert 'nested = model.get_submodule("language_model")' in source
    assert "model.get_output_embeddings = nested.get_output_embeddings" in source


def test_scaffold_computes_a_rope_index_that_counts_media_across_the_batch_one_row_at_a_time():
    """HunYuan-VL's `get_rope_index` numbers images across the whole batch (the second
    row's first image gets index 1), though each row alone is right: a padded batch differs
    from each prompt alone with the model's own positions. The scaffold then tries the
    written adapter's position_ids calling the model's rope index one row at a time, with
    each row's share of the per-image grids (its runs of the config's image token)."""
    from types import SimpleNamespace

    import torch

    from scaffold_setup import discovered, rendered

    from mmrl.positions import rope_index_per_row
    from mmrl.scaffold import quiet_transformers
    from mmrl.scaffold.resolve import resolve
    from mmrl.scaffold.verify import _has_rope_index

    image = 7

    class CountsAcrossRows(torch.nn.Module):
        config = SimpleNamespace(image_token_id=image)

        def get_rope_index(self, input_ids, image_grid_thw=None, attention_mask=None):
            positions = torch.zeros(2, *input_ids.shape, dtype=torch.long)
            grids, seen = iter(image_grid_thw.tolist()), 0  # one counter for the whole batch
            for row, ids in enumerate(input_ids):
                real = attention_mask[row].bool()
                line = torch.arange(int(real.sum())).expand(2, -1).clone()
                for start in (ids[real].eq(image) & ~ids[real].roll(1).eq(image)).nonzero().flatten().tolist():
                    line[1, start] = 100 * seen + next(grids)[0]
                    seen += 1
                positions[:, row, real] = line
            return positions, None

    class Wrapper(torch.nn.Module):
        config = CountsAcrossRows.config

        def __init__(self):
            super().__init__()
            self.model = CountsAcrossRows()

    # Row 0: one image; row 1 (left-padded): text, then two images.
    ids = torch.tensor([[1, 1, image, image, 2, 3], [0, image, 4, image, image, 5]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    grids = torch.tensor([[11, 1, 1], [12, 1, 1], [13, 1, 1]])
    batch = {"input_ids": ids, "attention_mask": mask, "image_grid_thw": grids}
    model = Wrapper()
    per_row = rope_index_per_row(model, batch)
    alone = [model.model.get_rope_index(ids[r:r + 1], grids[g], mask[r:r + 1])[0] for r, g in
             ((0, slice(0, 1)), (1, slice(1, 3)))]
    assert torch.equal(per_row, torch.cat(alone, dim=1))
    assert not torch.equal(per_row, model.model.get_rope_index(ids, grids, mask)[0])
    assert per_row[1, 1].tolist() == [0, 12, 1, 113, 3, 4]  # the second row's images numbered from 0

    with quiet_transformers():
        assert _has_rope_index(resolve("hunyuan_vl")) and not _has_rope_index(resolve("llama"))
    found = discovered("llama", "llama_scaffold")
    assert "def position_ids" not in rendered(found, capabilities=False)
    per_row_found = dataclasses.replace(found, rope_index_per_row=True)
    source = rendered(per_row_found, capabilities=False)
    assert "        return rope_index_per_row(model, batch)" in source
    assert "from mmrl.positions import rope_index_per_row\n" in source
    compile(source, "adapter.py", "exec")


@pytest.mark.parametrize("runs_with_own", [True, False])
def test_scaffold_retries_a_tiny_model_that_counted_positions_stop_with_its_own(monkeypatch, runs_with_own):
    """InstructBLIP-Video passes the adapter's counted positions on through **kwargs to its
    Q-Former, whose sequence is another length: the tiny model does not run at all. The
    checks run again with the model placing its own positions, kept where it then runs;
    where it does not run either, both causes are left to fill in."""
    import importlib
    from types import SimpleNamespace

    from mmrl.adapter import Capabilities

    verify_stage = importlib.import_module("mmrl.scaffold.verify")  # the package exports its function

    def verify_once(d, layout, notes, gaps):
        if d.own_positions and runs_with_own:
            return Capabilities(generation=True)
        cause = "Number of elements of source" if d.own_positions else "tensor a (76) must match (204)"
        d.fill_in.append(f"tiny(): the scaffolded tiny model does not run ({cause})")
        return None

    monkeypatch.setattr(verify_stage, "_verify_once", verify_once)
    d = SimpleNamespace(own_positions=False, redraw_zeros=(), fill_in=["earlier: kept"])
    verified = verify_stage.verify(d, None, [])
    if runs_with_own:
        assert verified == Capabilities(generation=True) and d.own_positions
        assert d.fill_in == ["earlier: kept"]
    else:
        assert verified is None and not d.own_positions
        assert d.fill_in == ["earlier: kept", "tiny(): the scaffolded tiny model does not run (tensor a (76) must "
                             "match (204))", "with the model's own positions, tiny(): the scaffolded tiny model "
                             "does not run (Number of elements of source)"]


def test_scaffold_encodes_one_image_per_call_where_the_tower_mixes_a_batchs_images():
    """MiniMax-M3-VL's tower (transformers' code) runs every image's patches as one
    sequence without a mask between images: an image's features change with the other
    images of its batch. The scaffold finds that by running the tiny model and declares
    encode_images_alone, whose per-image encoding gives each image its features alone."""
    from scaffold_setup import discovered, rendered

    found = discovered("minimax_m3_vl", "minimax_m3_vl")
    assert found.encode_images_alone
    assert "    encode_images_alone = True" in rendered(found, capabilities=False)
