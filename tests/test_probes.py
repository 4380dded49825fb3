"""Probes, the support matrix and `mmrl doctor`.

The status rules on hand-made probes; real probes on a text family; a broken
out-of-tree family caught by `mmrl doctor`; an unregistered checkpoint; the committed
matrix covering every family and feature; staleness comparison; GPU cells merged; and a
new family added with `--plugin` adding its row and changing nothing else.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mmrl.probes import FEATURES, PROBES, NotRunHere, Probe, Status, Subject, Verified, probe
from mmrl.probes import matrix as sm
from mmrl.probes.render import render_html, render_markdown
from mmrl.registry import families, get_adapter

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "support_matrix"


def _mmrl(*args: str, cwd=REPO, timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **env}
    return subprocess.run([sys.executable, "-m", "mmrl.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=environment)


# -- status rules -------------------------------------------------------------------------
def _subject(family: str = "qwen2") -> Subject:
    return Subject(adapter=get_adapter(family), source=family)


def _boom(subject):
    raise RuntimeError("exploded\nsecond line")


@pytest.mark.parametrize(
    ("capability", "check", "status", "gates", "reason"),
    [
        (None, lambda s: Verified("fine"), Status.VERIFIED, False, "fine"),
        ("generation", lambda s: Verified("fine"), Status.VERIFIED, False, "fine"),
        ("video", lambda s: Verified("fine"), Status.VERIFIED, False, "fine"),  # works, not declared
        (None, _boom, Status.FAILED, True, "RuntimeError: exploded"),  # required: CI gates
        ("generation", _boom, Status.FAILED, True, "RuntimeError: exploded"),  # declared: CI gates
        ("video", _boom, Status.FAILED, False, "RuntimeError: exploded"),  # not declared: shown only
        ("video", lambda s: (_ for _ in ()).throw(NotRunHere("no GPU")), Status.NOT_RUN, False, "no GPU"),
        ("video", lambda s: (_ for _ in ()).throw(NotRunHere("missing", unimplemented=True)), Status.NOT_RUN, False,
         "missing"),
        ("generation", lambda s: (_ for _ in ()).throw(NotRunHere("missing", unimplemented=True)), Status.FAILED,
         True, "declared, but missing"),
    ],
)
def test_status_rules(capability, check, status, gates, reason):
    result = Probe("x", "X", "a test probe", check, capability=capability).run(_subject())
    assert result.status is status
    assert result.gates is gates
    assert result.reason == reason
    assert result.seconds >= 0 and result.device and result.versions["torch"] and result.date
    if capability == "critic" and status in (Status.VERIFIED, Status.FAILED):
        assert "not declared" in result.evidence["note"]


def test_not_applicable_is_decided_before_running():
    ran = []
    p = Probe("x", "X", "d", lambda s: ran.append(1), inapplicable=lambda a: "text-only family")
    result = p.run(_subject())
    assert result.status is Status.NOT_APPLICABLE and result.reason == "text-only family" and not ran


def test_declared_capabilities_whose_probe_does_not_apply_are_named_apart():
    """What `mmrl models` lists apart: declared, but n/a for the family (media sharing in a
    text family), decided by the probes' own `inapplicable`, not by the command line."""
    from mmrl.probes import declared_not_applicable
    from mmrl.registry import families

    text = next(a for a in families() if a.modalities == ("text",) and a.capabilities.media_sharing)
    vision = next(a for a in families() if "image" in a.modalities and a.capabilities.media_sharing)
    assert declared_not_applicable(text) == ["media_sharing"]
    assert declared_not_applicable(vision) == []


def test_every_feature_of_the_issue_has_a_probe():
    wanted = {"random_init", "save_reload", "rope", "forward_backward", "generation", "padding_free", "freeze",
              "lora_language", "lora_vision", "gradient_checkpointing", "fsdp2", "sequence_parallel", "vllm",
              "single_image", "multi_image", "video", "critic"}
    assert wanted <= set(FEATURES)
    from dataclasses import fields

    from mmrl.adapter import Capabilities

    # Every declarable capability is verified by some probe.
    assert {f.name for f in fields(Capabilities)} <= {p.capability for p in PROBES}


def test_the_docs_explain_every_column():
    docs = (REPO / "docs" / "support_matrix.md").read_text()
    for p in PROBES:
        assert f"| {p.title} |" in docs, p.title
        assert p.capability is None or f"`{p.capability}`" in docs


# -- real probes on a text family (in process) --------------------------------------------
@pytest.mark.parametrize("feature", ["random_init", "save_reload", "rope", "padded_batch", "padding_free", "freeze",
                                     "lora_language", "critic"])
def test_text_family_probes_verify(feature):
    result = probe(feature).run(_subject("qwen2"))
    assert result.status is Status.VERIFIED, result.reason


def test_text_family_skips_what_it_cannot_do(monkeypatch):
    subject = _subject("qwen2")
    for feature in ("single_image", "multi_image", "video", "lora_vision"):
        assert probe(feature).run(subject).status is Status.NOT_APPLICABLE
    # Where vLLM is missing the probe says so (checked here with vLLM hidden, so also where
    # it is installed: there the probe itself runs in test_vllm.py's scaffolded families
    # and in CI's support-matrix check).
    _hide_vllm(monkeypatch)
    vllm = probe("vllm").run(subject)
    assert vllm.status is Status.NOT_RUN and vllm.reason == "vllm not installed"


def test_vlm_video_probe():
    result = probe("video").run(_subject("qwen2_vl"))
    assert result.status is Status.VERIFIED, result.reason


# -- doctor -------------------------------------------------------------------------------
BROKEN_FAMILY = '''
"""A family whose position ids are wrong: the padded-batch probe must catch it."""
from mmrl.adapter import DECODER_PARTS, Capabilities, ModelAdapter, TinyModel
from mmrl.registry import register_model
from mmrl.tiny import char_tokenizer, tiny_text_config


@register_model
class Broken(ModelAdapter):
    family = "broken"
    model_types = ("broken_decoder",)
    architectures = ("BrokenForCausalLM",)
    hf_class = "transformers:Qwen2ForCausalLM"
    parts = DECODER_PARTS
    shard_layers = ("Qwen2DecoderLayer",)
    capabilities = Capabilities(critic=True)

    def position_ids(self, model, batch):
        return batch["attention_mask"].long() * 0 + 3

    def tiny(self):
        tokenizer = char_tokenizer(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
        return TinyModel(config=tiny_text_config("transformers:Qwen2Config", tokenizer), processor=tokenizer)
'''


@pytest.mark.multiprocess
def test_doctor_fails_a_family_that_breaks_its_contract(plugin_path, monkeypatch):
    """In this process, probes included (`--workers 0`; its torchrun probes import the
    plugin through the path this process passes on): the worker pool that loads a plugin
    runs in test_plugin_family_adds_its_row_and_changes_nothing_else."""
    from rich.console import Console

    import mmrl.cli

    (plugin_path / "broken_family.py").write_text(BROKEN_FAMILY)
    monkeypatch.setattr(mmrl.cli, "console", Console(width=200))  # the table's reasons unclipped
    result = _mmrl_in_process("--plugin", "broken_family", "doctor", "broken", "--workers", "0", "--no-progress")
    assert result.exit_code == 1, (result.output, result.exception)
    lines = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") > 3}
    assert {p.title for p in PROBES} <= set(lines)
    assert "failed" in lines["Padded batch"] and "left-padded batch differs" in lines["Padded batch"]
    assert "verified" in lines["Critic head"] and "yes" in lines["Critic head"]  # declared, works
    assert "verified" in lines["RoPE"] and "required" in lines["RoPE"]
    assert "feature(s) fail: save_reload, padded_batch, padding_free, rollout_agreement" in result.stdout


@pytest.mark.multiprocess
def test_doctor_on_a_checkpoint(tmp_path, monkeypatch):
    """Every probe on a checkpoint folder (its torchrun probes load the folder in their own
    processes). In this process with vLLM hidden: the vLLM probes' engine starts were two
    thirds of the command's time and do not depend on where the weights came from (vLLM
    loads the engine's own copy); test_vllm.py and CI's support-matrix check run them."""
    from mmrl import build_model

    build_model("qwen2", random_init=True).save(tmp_path / "ckpt")
    _hide_vllm(monkeypatch)
    result = _mmrl_in_process("doctor", str(tmp_path / "ckpt"), "--json", "--workers", "0", "--no-progress")
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads(result.stdout)
    assert report["family"] == "qwen2" and report["subject"] == str((tmp_path / "ckpt").resolve())
    by_feature = {r["feature"]: r for r in report["results"]}
    assert "loaded from the checkpoint" in by_feature["random_init"]["reason"]
    assert all(r["status"] in ("verified", "n/a", "not run here") for r in report["results"]), report


def _hide_vllm(monkeypatch) -> None:
    """vLLM looks uninstalled to the probes (they ask importlib.util.find_spec)."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))


def _mmrl_in_process(*args: str):
    """`mmrl ARGS` in this process through the CLI's own `app` (the `mmrl` script's entry
    point), for a check of what a command prints, not of its process: a process paid
    ~5-10 s of interpreter start and imports."""
    from typer.testing import CliRunner

    from mmrl.cli import app

    return CliRunner().invoke(app, list(args))


def test_doctor_names_the_add_model_command_for_an_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "fancy_new_lm", "architectures": ["FancyLM"]}))
    result = _mmrl_in_process("doctor", str(tmp_path))
    assert result.exit_code == 2, (result.output, result.exception)
    assert "'fancy_new_lm' is not registered" in result.stderr
    assert "mmrl add-model fancy_new_lm" in result.stderr


def test_doctor_unknown_name():
    result = _mmrl_in_process("doctor", "no_such_family_xyz")
    assert result.exit_code == 2 and "no registered model family" in result.stderr, (result.output, result.exception)


# -- the committed matrix ------------------------------------------------------------------
def test_committed_matrix_lists_every_family_and_feature_with_evidence():
    document = sm.load(COMMITTED / sm.RESULTS_FILE)
    assert document is not None, "support_matrix/results.json is missing: run `mmrl support-matrix`"
    registered = [a.family for a in families()]
    assert [f["family"] for f in document["families"]] == registered
    assert [f["feature"] for f in document["features"]] == list(FEATURES)
    cells = {(c["family"], c["feature"]) for c in document["cells"] if c["platform"] == "cpu"}
    assert cells == {(f, feature) for f in registered for feature in FEATURES}
    for c in document["cells"]:
        assert c["status"] in {s.value for s in Status}
        assert c["reason"] and c["device"] and c["versions"] and c["date"], c
    readme = (COMMITTED / sm.MARKDOWN_FILE).read_text()
    page = (COMMITTED / sm.HTML_FILE).read_text()
    assert readme == render_markdown(document) and page == render_html(document)
    for family in registered:
        assert f"`{family}`" in readme and f'data-family="{family}"' in page
    for p in PROBES:
        assert f"| {p.title} |" in readme and f'data-feature="{p.feature}"' in page


def test_no_declared_capability_fails_in_the_committed_matrix():
    document = sm.load(COMMITTED / sm.RESULTS_FILE)
    failing = [f"{c['family']}/{c['feature']}: {c['reason']}" for c in sm.gating_failures(document)]
    assert not failing, failing


# -- staleness and merging ------------------------------------------------------------------
def _document():
    document = sm.load(COMMITTED / sm.RESULTS_FILE)
    return json.loads(json.dumps(document))


def test_differences_ignore_timings_dates_and_measured_numbers():
    old, new = _document(), _document()
    for c in new["cells"]:
        c["seconds"] += 1.5
        c["date"] = "2099-01-01"
        c["versions"] = {"torch": "9.9"}
        c["evidence"] = {"max_abs_diff": 0.5}
        c["reason"] = c["reason"].replace("e-07", "e-08")
    assert sm.differences(old, new) == []


def test_differences_report_status_changes_and_new_families_in_one_line():
    old, new = _document(), _document()
    new["cells"][0]["status"] = "failed"
    new["families"].append({"family": "toy", "modalities": ["text"], "declared": [], "model_types": ["t"],
                            "module": "x"})
    found = sm.differences(old, new)
    assert any("families changed (+['toy']" in line for line in found)
    first = old["cells"][0]
    assert any(f"{first['family']}/{first['feature']}: {first['status']} -> failed" in line for line in found)


def test_gpu_cells_are_merged_and_kept(tmp_path):
    """In this process (`--workers 0`, one rope probe per run): what the command writes is
    checked, not its process (which paid an interpreter start and imports per run)."""
    shutil.copytree(COMMITTED, tmp_path / "out")
    gpu = _document()
    gpu["cells"] = [dict(c, platform="gpu", device="Test GPU", versions={"torch": "2.11.0+cu130"},
                         date="2026-11-30") for c in gpu["cells"] if c["family"] == "qwen2" and c["platform"] == "cpu"]
    (tmp_path / "gpu.json").write_text(json.dumps(gpu))
    result = _mmrl_in_process("support-matrix", "--output", str(tmp_path / "out"), "--gpu-results",
                              str(tmp_path / "gpu.json"), "--family", "qwen2", "--feature", "rope", "--no-progress",
                              "--workers", "0")
    assert result.exit_code == 0, (result.output, result.exception)
    document = sm.load(tmp_path / "out" / sm.RESULTS_FILE)
    gpu_cells = [c for c in document["cells"] if c["platform"] == "gpu"]
    assert sorted(c["feature"] for c in gpu_cells if c["device"] == "Test GPU") == sorted(FEATURES)
    assert all(c["family"] == "qwen2" for c in gpu_cells if c["device"] == "Test GPU")
    stored = sm.load(tmp_path / "out" / sm.GPU_RESULTS_FILE)["cells"]
    assert sorted(map(json.dumps, stored)) == sorted(map(json.dumps, gpu_cells))
    assert "Recorded on GPU" in (tmp_path / "out" / sm.MARKDOWN_FILE).read_text()
    # A later regeneration without --gpu-results keeps them (gpu_results.json).
    result = _mmrl_in_process("support-matrix", "--output", str(tmp_path / "out"), "--family", "qwen2", "--feature",
                              "rope", "--no-progress", "--workers", "0")
    assert result.exit_code == 0, (result.output, result.exception)
    again = sm.load(tmp_path / "out" / sm.RESULTS_FILE)
    assert [c for c in again["cells"] if c["platform"] == "gpu"] == gpu_cells
    assert sm.differences(document, again) == []


def test_check_reports_a_hand_edited_page(tmp_path, monkeypatch):
    shutil.copytree(COMMITTED, tmp_path / "out")
    page = tmp_path / "out" / sm.MARKDOWN_FILE
    page.write_text(page.read_text().replace("✅", "❌", 1))
    committed = sm.load(COMMITTED / sm.RESULTS_FILE)
    monkeypatch.setattr(sm, "regenerate", lambda output, **kw: (committed, []))
    problems, _, _ = sm.check(tmp_path / "out")
    assert problems == [f"{page} was not generated from its results.json"]


# -- a new family adds its row and nothing else ----------------------------------------------
@pytest.mark.multiprocess
def test_plugin_family_adds_its_row_and_changes_nothing_else(tmp_path):
    out = tmp_path / "out"
    shutil.copytree(COMMITTED, out)
    # One worker process: the pool that imports the plugin's module, which the doctor
    # tests above (in process) leave to this one; a second worker only ran probes beside it.
    result = _mmrl("--plugin", "plugins.toy_family", "support-matrix", "--output", str(out), "--family", "toy",
                   "--no-progress", "--workers", "1", cwd=REPO / "tests", PYTHONPATH=str(REPO / "tests"))
    assert result.returncode == 0, result.stderr
    before, after = sm.load(COMMITTED / sm.RESULTS_FILE), sm.load(out / sm.RESULTS_FILE)
    toy = {c["feature"]: c for c in after["cells"] if c["family"] == "toy"}
    assert set(toy) == set(FEATURES)
    assert toy["padded_batch"]["status"] == "verified" and toy["fsdp2"]["status"] == "verified"
    assert toy["vllm"]["status"] == "n/a"  # the toy family names no vLLM architecture
    # Its tiny config is a plain Qwen2 config, so a saved toy checkpoint loads as that
    # family: the probe says so instead of quietly probing the other family.
    assert toy["save_reload"]["status"] == "failed" and "reloads as family" in toy["save_reload"]["reason"]
    assert "declared capability fails: toy/save_reload" in result.stdout.replace("\n", " ")
    after_without_toy = dict(after, families=[f for f in after["families"] if f["family"] != "toy"],
                             cells=[c for c in after["cells"] if c["family"] != "toy"])
    assert sm.differences(before, after_without_toy) == []
    assert "`toy`" in (out / sm.MARKDOWN_FILE).read_text()
    assert 'data-family="toy"' in (out / sm.HTML_FILE).read_text()


# -- multi_turn: an image from the environment in turn 3 ------------------------------------
@pytest.mark.multiprocess
def test_multi_turn_probe_verifies_and_names_where_the_prefix_rule_cannot_hold(monkeypatch):
    from mmrl.processing import Processing
    from mmrl.processors.idefics3 import Idefics3Processing
    from mmrl.processors.llava_onevision import LlavaOnevisionProcessing

    result = probe("multi_turn").run(_subject("qwen2_vl"))
    assert result.status is Status.VERIFIED, result.reason
    assert "positions" in result.reason and result.evidence["kept"] >= 1
    assert result.evidence["max_logprob_diff"] <= 2e-4
    # Its Ulysses part (one torchrun launch of mmrl.probes.multi_turn_sp): the same update
    # over 2 processes equals one process on the trajectory batch.
    assert "Ulysses over 2 processes equals one process" in result.reason, result.reason
    ulysses = result.evidence["sequence_parallel"]
    assert ulysses["max_logprob_diff"] <= 1e-5 and ulysses["gradient_tensors"] > 0, ulysses
    assert probe("multi_turn").run(_subject("qwen2")).status is Status.NOT_APPLICABLE
    # Without what the families' processing does to keep the rule (every image in anyres
    # tiles; an assistant's text written as sampled), the probe names why it cannot hold.
    monkeypatch.setattr(LlavaOnevisionProcessing, "arrange_images", Processing.arrange_images)
    llava = probe("multi_turn").run(_subject("llava_onevision"))
    assert llava.status is Status.FAILED and "opening turn is processed into other tokens" in llava.reason
    monkeypatch.setattr(Idefics3Processing, "render", Processing.render)
    idefics = probe("multi_turn").run(_subject("idefics3"))
    assert idefics.status is Status.FAILED and "writes ' ' before the assistant's text" in idefics.reason


def test_multi_turn_probe_catches_a_loss_mask_on_context(monkeypatch):
    """A training batch whose mask also covers a context token (the first one after the
    first policy turn: template scaffolding) must fail the probe."""
    import mmrl.rollout_batch as rollout_batch

    plain = rollout_batch.trajectory_sequences

    def widened(trajectories, *args, **kwargs):
        seqs = plain(trajectories, *args, **kwargs)
        context = (seqs.response_mask[0] == 0).nonzero()
        seqs.response_mask[0, context[0]] = 1
        return seqs

    monkeypatch.setattr(rollout_batch, "trajectory_sequences", widened)
    result = probe("multi_turn").run(_subject("qwen2_vl"))
    assert result.status is Status.FAILED and "loss mask" in result.reason


def test_a_gpu_cell_the_new_machine_could_not_run_keeps_the_earlier_result():
    def cell(feature, status, device, date):
        return {"family": "qwen2", "feature": feature, "status": status, "device": device, "date": date}
    old = [cell("fsdp2", "verified", "2 x H200", "2026-11-30"), cell("rope", "verified", "2 x H200", "2026-11-30"),
           cell("vllm", "not run here", "2 x H200", "2026-11-30")]
    new = [cell("fsdp2", "not run here", "1 x H200", "2026-12-01"), cell("rope", "failed", "1 x H200", "2026-12-01"),
           cell("vllm", "not run here", "1 x H200", "2026-12-01"), cell("video", "not run here", "1 x H200", "2026-12-01")]
    merged = {c["feature"]: c for c in sm.merge_gpu_cells(old, new)}
    assert merged["fsdp2"] == old[0]  # two GPUs ran it; one GPU could not: the run stays
    assert merged["rope"] == new[1]  # a cell that ran replaces the old one, whatever its status
    assert merged["vllm"] == new[2] and merged["video"] == new[3]  # nothing better to keep
