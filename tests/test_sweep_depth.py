"""The scaffold's depth stage and the coverage sweep around it: the gap line a limit of the
type gets (to_write), the decoder inputs the adapter's SequenceParallel declares
(sequence_inputs, rendered), the depth-only re-sweep (`mmrl add-model --sweep
--depth-only`) and the page rewritten from coverage.json (`python -m mmrl.scaffold.sweep
page`); the sweep's own processes are stood in for."""

import json
import subprocess
import sys

import pytest

from mmrl.scaffold import COLUMNS
from mmrl.scaffold import sweep
from mmrl.scaffold.sweep import Row, run_sweep, sweep_one, write_document

ALL_COLUMNS = {c: "n/a" for c in COLUMNS} | {"generation": "yes", "sequence_parallel": "yes"}


def fake_processes(monkeypatch, calls):
    """Stand in for the scaffold worker (it writes a "written" report) and pytest."""

    def run(command, seconds, env):
        calls.append("pytest" if "pytest" in command else "worker")
        if "worker" in command:
            report = command[-1]
            with open(report, "w") as f:
                json.dump({"stage": "write", "status": "written", "capabilities": ["generation", "sequence_parallel"],
                           "columns": ALL_COLUMNS, "gaps": [], "sequence_parallel_mode": "gathered"}, f)
        return 0, ""

    monkeypatch.setattr(sweep, "_run", run)


def test_depth_only_skips_the_generated_tests_and_keeps_the_green(monkeypatch):
    calls = []
    fake_processes(monkeypatch, calls)
    row = sweep_one("llama", "causal_lm", depth_only=True)
    assert calls == ["worker"], "a depth-only type must not run its generated tests again"
    assert row.status == "green" and row.stage == "depth-only" and row.columns == ALL_COLUMNS
    assert row.sequence_parallel_mode == "gathered", "the row records the mode sequence_parallel verified in"
    calls.clear()
    row = sweep_one("llama", "causal_lm")
    assert calls == ["worker", "pytest"] and row.stage == "tests"


def test_depth_only_takes_green_rows_lacking_columns_vlm_first(monkeypatch, tmp_path):
    path = tmp_path / "coverage.json"
    rows = {
        "llama": Row("llama", "causal_lm", True, "green", "tests", "", capabilities=["generation"]),
        "llava": Row("llava", "image_text_to_text", True, "green", "tests", "", capabilities=["generation"]),
        "qwen3": Row("qwen3", "causal_lm", True, "green", "tests", "", capabilities=["generation"],
                     columns=ALL_COLUMNS, sequence_parallel_mode="ulysses"),  # current: not run again
        # every column, but sequence_parallel's mode not recorded: run again to record it
        "qwen2": Row("qwen2", "causal_lm", True, "green", "tests", "", capabilities=["generation"],
                     columns=ALL_COLUMNS),
        "gpt2": Row("gpt2", "causal_lm", True, "model-init", "model", "it broke"),  # not green: not depth-only
    }
    import transformers

    write_document(path, rows, transformers.__version__)
    swept = []

    def one(model_type, mapping, scaffold_seconds, tests_seconds, depth_only=False, columns=None):
        swept.append((model_type, depth_only))
        return Row(model_type, mapping, True, "green", "depth-only", "", columns=ALL_COLUMNS,
                   sequence_parallel_mode="ulysses")

    monkeypatch.setattr(sweep, "sweep_one", one)
    document = run_sweep(path, progress=False, depth_only=True)
    assert swept == [("llava", True), ("llama", True), ("qwen2", True)]
    assert {r["model_type"]: r["stage"] for r in document["types"]}["gpt2"] == "model"
    swept.clear()
    run_sweep(path, types=["gpt2", "qwen3"], progress=False, depth_only=True)
    assert swept == [("gpt2", False), ("qwen3", True)], "a type recorded failing runs the whole sweep"

    def out_of_time(model_type, mapping, scaffold_seconds, tests_seconds, depth_only=False, columns=None):
        return Row(model_type, mapping, True, "timeout", "verify", "stage verify ran past the 1260 s limit")

    monkeypatch.setattr(sweep, "sweep_one", out_of_time)
    document = run_sweep(path, types=["qwen3", "mistral"], progress=False, depth_only=True)
    kept = {r["model_type"]: r["status"] for r in document["types"]}
    assert kept["qwen3"] == "green", "a depth-only type out of time keeps the green recorded"
    assert kept["mistral"] == "timeout", "a type not recorded green gets the sweep's verdict"


def test_the_page_is_rewritten_from_the_json_alone(tmp_path):
    """...with each depth gap's advice derived again from its cause (a row recorded with
    the generic advice reads as a new one would)."""
    path = tmp_path / "coverage.json"
    gap = {"column": "sequence_parallel", "cause": "log-probs differ from one process by 6.29e-04 (atol 1e-05)",
           "write": "the generic advice"}
    packed = {"column": "padding_free", "write": "write packed positions",
              "cause": "state crosses a packed sequence boundary (a short sample behind a long neighbour differs)"}
    rows = {"llama": Row("llama", "causal_lm", True, "green", "depth-only", "", capabilities=["generation"],
                         columns=ALL_COLUMNS),
            "qwen3_next": Row("qwen3_next", "causal_lm", True, "green", "tests", "", capabilities=["generation"],
                              columns=ALL_COLUMNS | {"sequence_parallel": "no"}, gaps=[gap, packed])}
    write_document(path, rows, "5.19.0")
    page = path.with_suffix(".md")
    page.write_text("stale\n")
    # What `python -m mmrl.scaffold.sweep page PATH` runs, in this process (a process of its
    # own imported torch and transformers for it); the command's own process runs below,
    # where it refuses a missing file before any of those imports.
    sweep.rewrite_page(path)
    assert "| `llama` | causal_lm | green | depth-only |" in page.read_text()
    (written,) = [r for r in json.loads(path.read_text())["types"] if r["model_type"] == "qwen3_next"]
    assert "linear_attention" in written["gaps"][0]["write"] and "linear_attention" in page.read_text()
    assert written["gaps"][1]["write"].startswith("keep padding_free=False: the decoder has layers that carry a state")
    done = subprocess.run([sys.executable, "-m", "mmrl.scaffold.sweep", "page", str(tmp_path / "none.json")],
                          capture_output=True, text=True)
    assert done.returncode == 1 and "none.json" in done.stderr and "\n" not in done.stderr.strip()


def test_a_sequence_parallel_limit_gets_its_own_gap_line_not_the_generic_one():
    import transformers

    from mmrl.scaffold.depth import TO_WRITE, to_write

    generic = TO_WRITE["sequence_parallel"]
    cases = {
        "ValueError: sequence parallelism runs on the text decoder's sdpa or eager attention, not 'flex_attention' "
        "(set model.attn_implementation: sdpa)": "runs flex_attention attention only",
        "ValueError: sequence-parallel attention does not support position biases or attention sinks on sdpa (set "
        "model.attn_implementation: eager)": "model.attn_implementation: eager",
        "ValueError: sequence parallelism (Ulysses) splits the attention heads of the text decoder over the "
        "processes, in transformers' attention interface, which no layer of this decoder calls: its layers "
        "(BloomBlock: BloomAttention, BloomMLP) h...": "keep sequence_parallel=False: mmrl's Ulysses splits",
        "ValueError: sequence parallelism needs keyword arguments for GPT2Model": "GPT2Model with positional",
        "ValueError: the decoder gets visual_pos_masks (4, 93) over the whole sequence, which sequence parallelism "
        "does not know how to cut": "masked_inputs=(('visual_pos_masks'",
    }
    for cause, advice in cases.items():
        line = to_write("sequence_parallel", cause)
        assert advice in line and line != generic, cause
    mismatch = "log-probs differ from one process by 6.29e-04 (atol 1e-05)"
    hybrid = to_write("sequence_parallel", mismatch, transformers.Qwen3NextConfig())
    assert "linear_attention" in hybrid and hybrid.startswith("keep sequence_parallel=False")
    assert to_write("sequence_parallel", mismatch, transformers.LlamaConfig()) == generic
    assert to_write("multi_turn", "anything") == TO_WRITE["multi_turn"]
    prefix = ("the opening turn is processed into other tokens once the reply image is in the conversation (33 of "
              "236 differ): the prefix rule cannot hold, so samples end before the reply")
    assert to_write("multi_turn", prefix).startswith("keep multi_turn=False: the processor lays the opening turn")
    assert "ran past" not in to_write("video", "ScaffoldError: stage 'depth' ran past its 540 s limit")
    assert "less loaded host" in to_write("video", "ScaffoldError: stage 'depth' ran past its 540 s limit")


def test_the_decoder_inputs_along_the_sequence_become_the_adapters_sequence_parallel():
    """qwen3_vl's decoder gets visual_pos_masks and one deepstack feature row per True
    position (the zoo adapter declares them by hand): found by running the tiny model;
    a decoder that gets nothing more keeps the default (None)."""
    from mmrl.probes import Subject
    from mmrl.registry import get_adapter
    from mmrl.scaffold.depth import sequence_inputs

    found = sequence_inputs(Subject(get_adapter("qwen3_vl"), source="qwen3_vl"))
    assert found == get_adapter("qwen3_vl").sequence_parallel
    assert sequence_inputs(Subject(get_adapter("qwen3"), source="qwen3")) is None


def test_the_scaffold_writes_the_sequence_parallel_it_found():
    import ast

    from scaffold_setup import discovered, rendered

    from mmrl.adapter import SequenceParallel

    found = discovered("qwen3_vl", "sp_written")
    assert "sequence_parallel =" not in rendered(found)
    found.sequence_parallel = SequenceParallel(masked_inputs=(("visual_pos_masks", ("deepstack_visual_embeds",)),))
    source = rendered(found)
    ast.parse(source)
    flat = " ".join(source.split()).replace("( ", "(").replace(", )", ")")
    assert ('sequence_parallel = SequenceParallel(split_inputs=("input_ids", "position_ids", "labels"), '
            'masked_inputs=(("visual_pos_masks", ("deepstack_visual_embeds",)),))') in flat
    assert "SequenceParallel" in source.split("from mmrl.adapter import", 1)[1].split("from mmrl.processors")[0]
    assert all(len(line) <= 116 for line in source.splitlines() if line.startswith("from mmrl.adapter"))


def test_a_forward_that_fails_while_looking_for_decoder_inputs_leaves_the_default(monkeypatch):
    """verify_depth keeps the default SequenceParallel when finding the decoder's inputs
    fails (the Ulysses probe then says what fails), instead of failing the scaffold."""
    from mmrl.adapter import Capabilities
    from mmrl.scaffold import depth as depth_module

    class Found:
        sequence_parallel = None
        tiny = None

    def boom(subject):
        raise RuntimeError("the forward failed")

    ran = []
    monkeypatch.setattr(depth_module, "applicable", lambda d, capabilities: ["sequence_parallel"])
    monkeypatch.setattr(depth_module, "scratch_family", lambda *args: __import__("contextlib").nullcontext("subject"))
    monkeypatch.setattr(depth_module, "sequence_inputs", boom)
    monkeypatch.setattr(depth_module, "_run", lambda column, subject, depth: ran.append(column))
    found = Found()
    depth_module.verify_depth(found, None, depth_module.Depth(Capabilities()))
    assert found.sequence_parallel is None and ran == ["sequence_parallel"]


def test_depth_only_with_fresh_is_refused_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from mmrl.cli import app

    result = CliRunner().invoke(app, ["add-model", "--sweep", "--depth-only", "--fresh", "--coverage",
                                      str(tmp_path / "coverage.json"), "--no-progress"])
    assert result.exit_code == 2 and "--depth-only" in result.output and "--fresh" in result.output
    assert not (tmp_path / "coverage.json").exists()


def test_the_scaffold_writes_gathered_mixers():
    import ast

    from scaffold_setup import discovered, rendered

    from mmrl.adapter import SequenceParallel

    found = discovered("gpt2", "sp_gathered")
    found.sequence_parallel = SequenceParallel(gather_mixers=True)
    source = rendered(found)
    ast.parse(source)
    assert "    sequence_parallel = SequenceParallel(gather_mixers=True)" in source.splitlines()


def test_the_result_names_the_sequence_parallel_mode_the_adapter_declares():
    """"gathered" where the written spec gathers mixers, "ulysses" for any other spec (or
    none: the default's), "" where sequence_parallel is not declared."""
    from types import SimpleNamespace

    from mmrl.adapter import Capabilities, SequenceParallel
    from mmrl.scaffold import sequence_parallel_mode

    declared = Capabilities(sequence_parallel=True)
    found = SimpleNamespace(sequence_parallel=SequenceParallel(gather_mixers=True))
    assert sequence_parallel_mode(found, declared) == "gathered"
    assert sequence_parallel_mode(found, Capabilities(sequence_parallel=False)) == ""
    assert sequence_parallel_mode(found, None) == ""
    assert sequence_parallel_mode(SimpleNamespace(sequence_parallel=None), declared) == "ulysses"
    found = SimpleNamespace(sequence_parallel=SequenceParallel(split_inputs=("input_ids", "token_type_ids")))
    assert sequence_parallel_mode(found, declared) == "ulysses"


def _sequence_parallel_failed(depth_module, cause):
    from mmrl.adapter import Capabilities

    depth = depth_module.Depth(Capabilities())
    depth.decide("sequence_parallel", False, cause)
    return depth


@pytest.mark.parametrize("verified", [True, False])
def test_a_failed_ulysses_probe_is_run_again_with_gathered_mixers(monkeypatch, verified):
    """Declared with SequenceParallel(gather_mixers=True) where that verifies (the gap
    goes); else the Ulysses spec stays and the gap gives both causes."""
    from types import SimpleNamespace

    import mmrl.probes as probes
    from mmrl.probes import Status
    from mmrl.scaffold import depth as depth_module

    ran = []

    class Probe:
        def run(self, subject):
            ran.append(found.sequence_parallel)
            return SimpleNamespace(status=Status.VERIFIED if verified else Status.FAILED,
                                   reason="" if verified else "log-probs differ from one process by 1e-03")

    monkeypatch.setattr(depth_module, "scratch_family", lambda *args: __import__("contextlib").nullcontext("subject"))
    monkeypatch.setattr(probes, "probe", lambda column: Probe())
    found = SimpleNamespace(sequence_parallel=None)
    depth = _sequence_parallel_failed(depth_module, "ValueError: sequence parallelism (Ulysses) splits the attention "
                                      "heads of the text decoder over the processes, in transformers' attention "
                                      "interface, which no layer of this decoder calls")
    depth_module.gather_mixers(found, None, depth)
    assert len(ran) == 1 and ran[0].gather_mixers
    assert depth.capabilities.sequence_parallel is verified
    if verified:
        assert depth.gaps == [] and found.sequence_parallel.gather_mixers
    else:
        assert found.sequence_parallel is None
        (gap,) = depth.gaps
        assert "which no layer of this decoder calls; gathered mixers: log-probs differ" in gap.cause
        assert gap.write.startswith("keep sequence_parallel=False: mmrl's Ulysses splits")


def test_a_ulysses_probe_out_of_time_is_not_run_again(monkeypatch):
    import mmrl.probes as probes
    from mmrl.scaffold import depth as depth_module

    monkeypatch.setattr(probes, "probe", lambda column: (_ for _ in ()).throw(AssertionError("ran again")))
    depth = _sequence_parallel_failed(depth_module, "ScaffoldError: stage 'depth' ran past its 540 s limit")
    depth_module.gather_mixers(object(), None, depth)
    assert not depth.capabilities.sequence_parallel and len(depth.gaps) == 1
