"""The helpers several modules share instead of each writing its own (issue 29, "fold
the twins"): one spec reader, the one-line error presets, the platform record and a
bench report's writer, and one ChatML-with-media template builder."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mmrl import adapter, errors, platform_info
from mmrl.imports import split_spec


@pytest.mark.parametrize(("spec", "parts"), [
    ("transformers:Qwen2VLForConditionalGeneration", ("transformers", "Qwen2VLForConditionalGeneration")),
    ("my_pkg.rewards.graded", ("my_pkg.rewards", "graded")),
    ("./my_rewards.py:graded", ("./my_rewards.py", "graded")),
    ("C:/x/r.py:graded", ("C:/x/r.py", "graded")),
    ("graded", ("", "graded")),
    ("dir/r.py", ("dir/r.py", "")),
])
def test_split_spec_reads_every_form(spec, parts):
    assert split_spec(spec) == parts


def test_adapter_import_object_names_what_the_module_lacks():
    assert adapter.import_object("collections:OrderedDict") is __import__("collections").OrderedDict
    assert adapter.import_object("collections.OrderedDict") is __import__("collections").OrderedDict
    with pytest.raises(ValueError, match=r"^class 'collections:NoSuchClass': module 'collections' has no class"):
        adapter.import_object("collections:NoSuchClass")


def test_one_module_runs_a_file_as_a_module(tmp_path):
    """`mmrl.imports.load_module` is the one place a file runs as a module: a spec's user
    file and the scaffold's rendered adapter both go through it."""
    import sys

    from mmrl.imports import load_module

    repo = Path(__file__).resolve().parents[1]
    runners = [str(path.relative_to(repo)) for folder in ("mmrl", "models", "processors")
               for path in sorted((repo / folder).rglob("*.py")) if "spec_from_file_location" in path.read_text()]
    assert runners == ["mmrl/imports.py"], runners

    (tmp_path / "good.py").write_text("VALUE = 3\n")
    (tmp_path / "bad.py").write_text("raise KeyError('no')\n")
    try:
        assert load_module("_mmrl_twins_good", tmp_path / "good.py").VALUE == 3
        assert sys.modules["_mmrl_twins_good"].VALUE == 3
        with pytest.raises(KeyError):
            load_module("_mmrl_twins_bad", tmp_path / "bad.py")
        assert "_mmrl_twins_bad" not in sys.modules
    finally:
        sys.modules.pop("_mmrl_twins_good", None)


def test_reward_metric_names_come_from_the_spec_reader():
    from mmrl.rewards import _part_names

    assert _part_names(["dir/r.py:graded", "pkg.mod.graded", "exact", "pkg:mean"]) == [
        "graded", "graded_2", "exact", "mean_2"]


def test_error_presets():
    exc = ValueError("first\n  second")
    assert errors.whole_cause(exc) == "ValueError: first second"
    assert errors.whole_cause(exc, 12) == "ValueErro..."
    assert errors.raised(exc) == "ValueError: first"
    assert errors.raised(KeyError()) == "KeyError: (no message)"


# Hand-written one-line forms of an exception that `mmrl.errors` names: the first line of its
# message (`str(exc).splitlines()[0]`, an IndexError when the message is blank), the whole
# message squeezed (`" ".join(str(exc).split())`), and `Type: message` spelled out.
HAND_WRITTEN_ONE_LINE = re.compile(
    r"str\((exc|e|err|error)\)(\.strip\(\))?\.splitlines\(\)\[0\]"
    r"|\" \"\.join\(str\((exc|e|err|error)\)\.split\(\)\)"
    r"|type\((exc|e|err|error)\)\.__name__\}: \{(exc|e|err|error)\}\"")


def test_no_module_writes_an_exceptions_one_line_form_by_hand():
    repo = Path(__file__).resolve().parents[1]
    found = [f"{path.relative_to(repo)}:{number}: {line.strip()}"
             for folder in ("mmrl", "models", "processors") for path in sorted((repo / folder).rglob("*.py"))
             if path != repo / "mmrl" / "errors.py"
             for number, line in enumerate(path.read_text().splitlines(), 1) if HAND_WRITTEN_ONE_LINE.search(line)]
    assert not found, "use mmrl.errors (one_line, whole_cause, raised) instead:\n" + "\n".join(found)


def test_the_hand_written_forms_are_seen():
    assert HAND_WRITTEN_ONE_LINE.search("({str(exc).splitlines()[0]})")
    assert HAND_WRITTEN_ONE_LINE.search('message = " ".join(str(exc).split())[:300]')
    assert HAND_WRITTEN_ONE_LINE.search('f"template: {type(exc).__name__}: {exc}")')
    assert not HAND_WRITTEN_ONE_LINE.search("one_line(exc, typed=True)")


def test_a_yaml_error_without_a_message_still_reads_as_one_line():
    import yaml

    from mmrl.config import _yaml_problem

    assert _yaml_problem(yaml.YAMLError()) == "YAMLError"


def test_a_failed_scaffold_stage_quotes_its_cause_on_one_line():
    from mmrl.scaffold import STAGE_SECONDS, ScaffoldError, stage_limit

    with pytest.raises(ScaffoldError) as error, stage_limit(next(iter(STAGE_SECONDS))):
        raise ValueError("first\n  second " + "x" * 300)
    cause = str(error.value).split(" failed: ", 1)[1]
    assert cause.startswith("ValueError: first second xx") and "\n" not in cause
    assert cause.split(" (at ")[0].endswith("...") and len(cause.split(" (at ")[0]) == 240


def test_platform_record_and_report(tmp_path, capsys):
    found = platform_info.versions(("torch", "no-such-package-mmrl"), missing="missing")
    assert found["no-such-package-mmrl"] == "missing" and "torch" in found and "python" in found
    assert "no-such-package-mmrl" not in platform_info.versions(("no-such-package-mmrl",))
    assert platform_info.device_name("cpu").startswith("cpu (")
    assert re.fullmatch(r".+, \d+ CPUs", platform_info.host())
    out = platform_info.write_report(tmp_path / "a" / "r.json", {"x": 1})
    assert json.loads(out.read_text()) == {"x": 1} and out.read_text().endswith("\n")
    assert capsys.readouterr().out == f"wrote {out}\n"

    from mmrl.probes import base  # the probes record the same platform
    assert base.versions is platform_info.versions and base.device_name is platform_info.device_name
    repo = Path(__file__).resolve().parents[1]
    elsewhere = [str(path.relative_to(repo)) for folder in ("mmrl", "models", "processors")
                 for path in sorted((repo / folder).rglob("*.py"))
                 if path.name != "platform_info.py" and "get_device_name" in path.read_text()]
    assert not elsewhere, f"name the device through mmrl.platform_info.device_name: {elsewhere}"
    by_hand = [str(path.relative_to(repo)) for folder in ("mmrl", "models", "processors")
               for path in sorted((repo / folder).rglob("*.py"))
               if path.name != "platform_info.py" and "platform.machine()" in path.read_text()]
    assert not by_hand, f"name the machine through mmrl.platform_info (host, device_name): {by_hand}"


def test_every_bench_writes_its_report_through_write_report():
    """A bench's report (its --out file or a file in bench/results/) is written by
    `mmrl.platform_info.write_report`; the files a bench hands between its own processes
    (a worker's result, a replay) are not reports."""
    repo = Path(__file__).resolve().parents[1]
    by_hand, unfolded = [], []
    for path in sorted((repo / "bench").glob("*.py")):
        source = path.read_text()
        by_hand += [f"{path.name}:{number}" for number, line in enumerate(source.splitlines(), 1)
                    if re.search(r"(\bout\b|RESULTS).*\.write_text\(json\.dumps", line)]
        if re.search(r"\"--out\"|bench/results/|RESULTS /", source) and "write_report" not in source:
            unfolded.append(path.name)
    assert not by_hand and not unfolded, f"reports written by hand: {by_hand}; benches without write_report: {unfolded}"


def _render(template: str, content) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    messages = [{"role": "user", "content": content}]
    return ImmutableSandboxedEnvironment().from_string(template).render(messages=messages, add_generation_prompt=True)


def test_chatml_with_media_places_parts_inline_or_media_first():
    from mmrl.processors import internvl, llava_onevision
    from mmrl.processors.templates import CHATML

    content = [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "video"}, {"type": "text", "text": "b"}]
    assert _render(CHATML, content) == ("<|im_start|>user\na<|vision_start|><|image_pad|><|vision_end|>"
                                        "<|vision_start|><|video_pad|><|vision_end|>b<|im_end|>\n<|im_start|>assistant\n")
    assert _render(internvl.CHAT_TEMPLATE, content) == (
        "<|im_start|>user\na<IMG_CONTEXT>\n<video>\nb<|im_end|>\n<|im_start|>assistant\n")
    assert _render(llava_onevision.CHAT_TEMPLATE, content) == (
        "<|im_start|>user\n<image>\n<video>\nab<|im_end|>\n<|im_start|>assistant\n")
    assert _render(CHATML, "plain") == "<|im_start|>user\nplain<|im_end|>\n<|im_start|>assistant\n"


def test_chatml_with_media_quotes_placeholders():
    from mmrl.processors.templates import chatml_with_media

    assert _render(chatml_with_media("it's\\"), [{"type": "image"}]).startswith("<|im_start|>user\nit's\\<|im_end|>")


@pytest.mark.slow  # the scaffold inspects a type's classes (seconds)
def test_the_scaffold_renders_its_template_through_chatml_with_media():
    """A scaffolded vision-language adapter names its placeholders and calls
    `chatml_with_media` instead of spelling a fourth ChatML template out."""
    import ast

    from scaffold_setup import discovered, rendered

    from mmrl.processors.templates import chatml_with_media
    from mmrl.scaffold.render import _text_expression

    found = discovered("qwen3_vl", "chatml_twin")
    source = rendered(found)
    assignment = next(node for node in ast.parse(source).body if isinstance(node, ast.Assign)
                      and getattr(node.targets[0], "id", None) == "CHAT_TEMPLATE")
    assert ast.unparse(assignment.value).startswith("chatml_with_media(") and "im_start" not in source
    expression = compile(ast.Expression(assignment.value), "adapter", "eval")
    template = eval(expression, {"chatml_with_media": chatml_with_media})
    content = [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "video"}]
    # Each placeholder inside the start/end pair the config names (`vision_start_token_id`).
    assert _render(template, content) == (
        "<|im_start|>user\na<vision_start><|image_pad|><vision_end><vision_start><|video_pad|><vision_end>"
        "<|im_end|>\n<|im_start|>assistant\n")
    assert _text_expression("<image>" * 64) == '"<image>" * 64' and _text_expression("<i>") == '"<i>"'


@pytest.mark.parametrize(("keywords", "grouped", "causal", "options"), [
    ({"scale", "window_size", "enable_gqa"}, True, True, {"window_size": (-1, 0), "enable_gqa": True}),
    ({"scale", "window_size", "enable_gqa"}, False, False, {}),
    ({"scale", "window_size", "enable_gqa"}, True, False, {"enable_gqa": True}),
    ({"scale", "is_causal"}, True, True, {"is_causal": True}),  # torch 2.11: no window, no flag
    ({"scale", "is_causal"}, True, False, {}),
])
def test_one_reading_of_the_varlen_kernels_options(monkeypatch, keywords, grouped, causal, options):
    """The decoder's and the vision tower's varlen calls take their options from
    `mmrl.engine.varlen.kernel_options`: a torch whose kernel lacks `enable_gqa` is not
    handed it by either, and `kernel_dtype` is one function."""
    from mmrl.engine import varlen, vision_attention

    monkeypatch.setattr(varlen, "_OPTIONS", [frozenset(keywords)])
    assert varlen.kernel_options(grouped, causal=causal) == options
    assert vision_attention.kernel_options is varlen.kernel_options
    assert vision_attention.kernel_dtype is varlen.kernel_dtype
    repo = Path(__file__).resolve().parents[1]
    readers = [str(path.relative_to(repo)) for path in sorted((repo / "mmrl").rglob("*.py"))
               if '"enable_gqa"' in path.read_text() or "window_size" in path.read_text()]
    assert readers == ["mmrl/engine/varlen.py"], readers
