"""The reads_media and rollout_agreement probes, their figure on the support-matrix page,
and the trainer's step-0 media check (`trainer.strict_media`).

    .venv/bin/python -m pytest -q tests/test_media_probes.py          # CPU
    .venv/bin/python -m pytest -q -m gpu tests/test_media_probes.py   # the bf16 figures, on a GPU
"""

import importlib
import importlib.util
import sys

import pytest
import torch

from mmrl import media_check
from mmrl.config import RecipeError, load_recipe
from mmrl.probes import Status, Subject, probe
from mmrl.probes.reads_media import media_conversations
from mmrl.probes.render import figure, render_html, render_markdown
from mmrl.registry import get_adapter, unregister
from mmrl.rollout import make_rollout

VLM_RECIPE = ["trainer.eval_every=0", "data.eval=null", "data.validation=null", "data.prompts_per_step=4",
              "data.train=synthetic:count_shapes?n=16&seed=0&image_size=56", "rollout.samples_per_prompt=2",
              "rollout.max_new_tokens=2", "model.tiny_vocabulary={}", "reward.options={}", "trainer.steps=1",
              "trainer.export=false", "trainer.progress=false", "trainer.summary=false", "trainer.samples_every=0"]


def _subject(family: str, device: str = "cpu") -> Subject:
    return Subject(adapter=get_adapter(family), source=family, device=device)


@pytest.fixture
def blind_families():
    """`plugins/blind_vlm.py`'s two families, registered for one test."""
    module = importlib.import_module("plugins.blind_vlm")
    yield module
    for family in ("vlm_drops_pixels", "vlm_zeroes_pixels"):
        unregister(family)
    sys.modules.pop("plugins.blind_vlm", None)


# -- reads_media ----------------------------------------------------------------------------
def test_variants_change_only_the_pixels():
    conversations = media_conversations()
    variants = media_check.media_variants(conversations)
    real = [media_check.media_of(c) for c in conversations]
    blank = [media_check.media_of(c) for c in variants["blank"]]
    shuffled = [media_check.media_of(c) for c in variants["shuffled"]]
    assert [[i.size for i in row] for row in blank] == [[i.size for i in row] for row in real]
    assert all(low == high for row in blank for i in row for low, high in i.getextrema())
    # The two 56x56 images trade places; the 84x112 one has no partner and stays.
    assert shuffled[0][0] is real[1][0] and shuffled[1][0] is real[0][0] and shuffled[2][0] is real[2][0]
    assert media_check.changed_rows(conversations, variants["shuffled"]) == [0, 1]
    assert media_check.changed_rows(conversations, variants["blank"]) == [0, 1, 2]
    assert [m["content"][1] for m in (c[0] for c in variants["shuffled"])] == \
        [m["content"][1] for m in (c[0] for c in conversations)]  # the text is untouched


def test_clips_trade_places_only_with_clips_of_as_many_frames():
    """A 2-frame clip and a 56x56 image never swap (their placeholder tokens differ); two
    2-frame clips do, and a 3-frame clip has no partner."""
    from PIL import Image

    def frame(grey):
        return Image.new("RGB", (56, 56), (grey,) * 3)

    media = [[frame(10), frame(20)], frame(30), [frame(40), frame(50)], [frame(60)] * 3]
    conversations = [[{"role": "user", "content": [{"type": "video" if isinstance(value, list) else "image",
                                                    "video" if isinstance(value, list) else "image": value}]}]
                     for value in media]
    shuffled = [media_check.media_of(c)[0] for c in media_check.media_variants(conversations)["shuffled"]]
    assert shuffled[0] is media[2] and shuffled[2] is media[0]
    assert shuffled[1] is media[1] and shuffled[3] is media[3]


def test_reads_media_verifies_a_zoo_vlm_on_both_paths(monkeypatch):
    _without_vllm(monkeypatch)
    result = probe("reads_media").run(_subject("qwen2_vl"))
    assert result.status is Status.VERIFIED, result.reason
    assert result.reason.endswith("; vLLM's rollout path not checked (vllm not installed)")
    assert result.evidence["vllm"] == {"unchecked": "vllm not installed"}
    figures = result.evidence["min_logprob_diff"]
    assert set(figures) == {f"{path}/{variant}" for path in ("rollout", "training") for variant in ("blank", "shuffled")}
    assert min(figures.values()) > media_check.READS_MEDIA_BOUND
    assert result.evidence["vision_tower_calls"] == {"rollout": 1, "training": 1}
    assert result.evidence["pixel_max_diff_rollout_vs_training"] == 0.0
    assert probe("reads_media").run(_subject("qwen2")).status is Status.NOT_APPLICABLE


def test_reads_media_fails_in_one_line_when_the_tower_is_never_called(blind_families):
    result = probe("reads_media").run(_subject("vlm_drops_pixels"))
    assert result.status is Status.FAILED and result.gates
    assert result.reason == ("the vision tower (model.visual) is never called on the rollout path, though 3 of 3 "
                             "prompts carry images or video: the processed batch holds no media tensor (the "
                             "processor drops the pixels)")


def test_reads_media_fails_when_the_pixels_do_not_matter(blind_families):
    result = probe("reads_media").run(_subject("vlm_zeroes_pixels"))
    assert result.status is Status.FAILED
    assert "log-probs with blank images differ from those with the real images by at most 0.0e+00" in result.reason
    assert "does not read its media" in result.reason and "\n" not in result.reason


def test_reads_media_fails_when_the_paths_feed_the_tower_other_pixels(monkeypatch):
    plain = media_check.training_logprobs

    def training_on_blank_images(engine, processing, conversations, ids, mask):
        return plain(engine, processing, media_check.media_variants(conversations)["blank"], ids, mask)

    monkeypatch.setattr(media_check, "training_logprobs", training_on_blank_images)
    result = probe("reads_media").run(_subject("qwen2_vl"))
    assert result.status is Status.FAILED
    assert result.reason.startswith("the vision tower (model.visual) receives other pixels on the rollout path than "
                                    "on the training path: values differ by up to")


def test_a_rollout_that_runs_its_own_model_leaves_the_training_path_to_check():
    """Under vLLM (its own copy of the model) no hook sees the rollout: the training path is
    still checked, and the reading says why the rollout path is not."""
    from mmrl.config import OptimConfig
    from mmrl.engine import Engine
    from mmrl.probes.launcher import single_process
    from mmrl.rollout import make_rollout

    class OwnModelRollout:  # a backend that is not the engine's HF model
        def __init__(self, inner):
            self.inner = inner

        def generate(self, conversations, params):
            return self.inner.generate(conversations, params)

    built = _subject("qwen2_vl").build()
    engine = Engine(built, single_process("cpu"), optim=OptimConfig(lr=1e-2), total_steps=1)
    rollout = OwnModelRollout(make_rollout("hf", engine, built.processing))
    reading = media_check.read_media(engine, rollout, built.processing, media_conversations())
    assert reading.problem is None and set(reading.figures) == {"training/blank", "training/shuffled"}
    assert reading.rollout_unchecked == "OwnModelRollout runs its own copy of the model (no hooks there)"
    assert "rollout path not checked" in reading.summary()


def _scoring_rollout(engine, processing, reads_media: bool):
    """A backend with its own copy of the model that scores given tokens, as vLLM does:
    with the conversations' media, or (`reads_media=False`) always with the first batch's."""
    first = []

    class ScoringRollout:
        def __init__(self, inner):
            self.inner = inner

        def generate(self, conversations, params):
            return self.inner.generate(conversations, params)

        def log_probs(self, conversations, ids, mask):
            first.append(conversations)
            scored = conversations if reads_media else first[0]
            return media_check.training_logprobs(engine, processing, scored, ids, mask)

    return ScoringRollout(make_rollout("hf", engine, processing))


@pytest.mark.parametrize("reads_media", [True, False])
def test_a_rollout_that_scores_tokens_itself_is_checked_through_its_scores(reads_media):
    """vLLM's path: no hook sees its copy of the model, so its own log-probs of the sampled
    tokens with each variant's media are compared, and the pixels are said not compared."""
    from mmrl.config import OptimConfig
    from mmrl.engine import Engine
    from mmrl.probes.launcher import single_process

    built = _subject("qwen2_vl").build()
    engine = Engine(built, single_process("cpu"), optim=OptimConfig(lr=1e-2), total_steps=1)
    rollout = _scoring_rollout(engine, built.processing, reads_media)
    reading = media_check.read_media(engine, rollout, built.processing, media_conversations())
    assert reading.rollout_unchecked is None and "ScoringRollout runs its own copy" in reading.pixels_unchecked
    if reads_media:
        assert reading.problem is None, reading.problem
        assert set(reading.figures) == {f"{p}/{v}" for p in ("rollout", "training") for v in ("blank", "shuffled")}
        assert "on both paths" in reading.summary() and "pixels not compared" in reading.summary()
    else:
        assert reading.problem.startswith("on the rollout path, log-probs with blank images differ from those with "
                                          "the real images by at most 0.0e+00")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
def test_reads_media_checks_the_vllm_rollout_path_where_installed():
    result = probe("reads_media").run(_subject("smolvlm"))
    assert result.status is Status.VERIFIED, result.reason
    assert "; VLLMRollout: log-probs move when the images do on its rollout path too" in result.reason
    figures = result.evidence["vllm"]["min_logprob_diff"]
    assert {"rollout/blank", "rollout/shuffled"} <= set(figures)
    assert min(figures.values()) > media_check.READS_MEDIA_BOUND


# -- rollout_agreement ----------------------------------------------------------------------
def _without_vllm(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))


def test_rollout_agreement_is_exact_in_fp32_and_skips_vllm_cleanly(monkeypatch):
    _without_vllm(monkeypatch)
    result = probe("rollout_agreement").run(_subject("qwen2_vl"))
    assert result.status is Status.VERIFIED, result.reason
    evidence = result.evidence
    assert evidence["precision"] == "fp32" and set(evidence["backends"]) == {"hf", "hf_compiled"}
    assert evidence["skipped"] == {"vllm": "vllm not installed"} and "vllm not run" in result.reason
    for figures in evidence["backends"].values():
        assert figures["max_abs_logprob_diff"] <= 1e-4 and 0 <= figures["kl"] <= 1e-8 and figures["tokens"] > 0
    assert evidence["figure"]["bound"] == 1e-4
    assert figure({"evidence": evidence}).endswith(" ≤ 1e-4")


def test_rollout_agreement_fails_when_a_backend_samples_with_other_log_probs(monkeypatch):
    """A sampler whose log-probs are off by 1e-3 (as a rollout that forgot a logit
    transform would be) fails the probe, naming the backend, and keeps its figure."""
    from mmrl.rollout.hf import HFRollout

    _without_vllm(monkeypatch)
    plain = HFRollout._generate

    def shifted(self, batch, shared, params):
        tokens, logprobs = plain(self, batch, shared, params)
        return tokens, None if logprobs is None else logprobs - 1e-3

    monkeypatch.setattr(HFRollout, "_generate", shifted)
    result = probe("rollout_agreement").run(_subject("qwen2"))
    assert result.status is Status.FAILED and result.gates
    assert result.reason.startswith("rollout and trainer log-probs disagree (fp32): hf: max |Δ log p| 1.00e-03")
    assert figure({"evidence": result.evidence}) == "1e-3 > 1e-4"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
def test_rollout_agreement_includes_vllm_where_installed():
    result = probe("rollout_agreement").run(_subject("qwen2"))
    assert result.status is Status.VERIFIED, result.reason
    assert set(result.evidence["backends"]) == {"hf", "hf_compiled", "vllm"}
    assert result.evidence["backends"]["vllm"]["max_abs_logprob_diff"] <= 1e-4


# -- the page ---------------------------------------------------------------------------------
def test_the_page_shows_the_figure_beside_its_bound():
    cell = {"family": "qwen2", "feature": "rollout_agreement", "platform": "cpu", "status": "verified",
            "declared": None, "reason": "fine", "seconds": 1.0, "device": "cpu", "versions": {"torch": "2"},
            "date": "2026-12-03", "evidence": {"figure": {"value": 4.8e-07, "bound": 1e-4, "what": "max"}}}
    document = {"schema": 1, "features": [{"feature": "rollout_agreement", "title": "Rollout agreement",
                                           "capability": None, "description": "d"}],
                "families": [{"family": "qwen2", "model_types": ["qwen2"], "modalities": ["text"], "declared": [],
                              "module": "m"}], "cells": [cell]}
    assert "| `qwen2` | text | ✅ 5e-7 ≤ 1e-4 |" in render_markdown(document)
    assert '<span class="figure">5e-7<br>≤1e-4</span>' in render_html(document)
    assert figure(dict(cell, evidence={})) == ""


def test_the_page_shows_the_gpu_bf16_figure_beside_its_bound_too():
    """A bf16 cell recorded on the H200 shows its figure against the bf16 bound in the
    GPU table, and beside the CPU figure in the HTML matrix."""
    base = {"family": "qwen2", "feature": "rollout_agreement", "status": "verified", "declared": None,
            "reason": "fine", "seconds": 1.0, "versions": {"torch": "2"}, "date": "2026-12-03"}
    cpu = dict(base, platform="cpu", device="cpu",
               evidence={"figure": {"value": 4.8e-07, "bound": 1e-4, "what": "max |Δ log p|, fp32"}})
    gpu = dict(base, platform="gpu", device="NVIDIA H200",
               evidence={"figure": {"value": 2.1e-02, "bound": 1e-1, "what": "max |Δ log p|, bf16"}})
    document = {"schema": 1, "features": [{"feature": "rollout_agreement", "title": "Rollout agreement",
                                           "capability": None, "description": "d"}],
                "families": [{"family": "qwen2", "model_types": ["qwen2"], "modalities": ["text"], "declared": [],
                              "module": "m"}], "cells": [cpu, gpu]}
    page = render_markdown(document)
    on_gpu = page.split("## Recorded on GPU", 1)[1]
    assert "| `qwen2` | text | ✅ 5e-7 ≤ 1e-4 |" in page.split("## Recorded on GPU", 1)[0]
    assert "| `qwen2` | text | ✅ 2e-2 ≤ 1e-1 |" in on_gpu
    html = render_html(document)
    assert '<span class="figure">5e-7<br>≤1e-4</span>' in html and '<span class="figure">2e-2<br>≤1e-1</span>' in html


# -- the trainer's step-0 check ------------------------------------------------------------------
def _vlm_recipe(tmp_path, *extra):
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny_vlm_count.yaml"
    return load_recipe(recipe, [*VLM_RECIPE, f"trainer.output_dir={tmp_path / 'run'}", *extra])


def _zeroed_pixels(monkeypatch):
    """Every batch's pixels zeroed: the model runs, and cannot see its images."""
    from mmrl.processors.qwen_vl import QwenVLProcessing

    plain = QwenVLProcessing.__call__

    def zeroed(self, conversations, add_generation_prompt=True):
        batch = plain(self, conversations, add_generation_prompt)
        batch["pixel_values"] = batch["pixel_values"] * 0
        return batch

    monkeypatch.setattr(QwenVLProcessing, "__call__", zeroed)


def test_step_zero_warns_in_one_line_when_the_model_does_not_read_its_images(tmp_path, monkeypatch, capsys):
    from mmrl.trainer import Trainer

    _zeroed_pixels(monkeypatch)
    Trainer(_vlm_recipe(tmp_path)).fit()
    warnings = [line for line in capsys.readouterr().err.splitlines() if "media check" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: step 0 media check: on the rollout path, log-probs "
                                                         "with blank images differ"), warnings
    assert warnings[0].endswith("(trainer.strict_media=true makes it an error)")


def test_step_zero_media_check_stops_a_strict_run(tmp_path, monkeypatch):
    from mmrl.trainer import Trainer

    _zeroed_pixels(monkeypatch)
    trainer = Trainer(_vlm_recipe(tmp_path, "trainer.strict_media=true"))
    with pytest.raises(media_check.MediaCheckError, match=r"^step 0 media check: .*does not read its media there "
                                                          r"\(trainer.strict_media=true\)$"):
        trainer.train_step()


def test_step_zero_media_check_passes_a_model_that_reads_its_images(tmp_path, monkeypatch, capsys):
    from mmrl.trainer import Trainer

    seen = []
    plain = media_check.step_zero_media_check
    monkeypatch.setattr("mmrl.trainer.step_zero_media_check", lambda *a, **k: seen.append(plain(*a, **k)))
    trainer = Trainer(_vlm_recipe(tmp_path, "trainer.strict_media=true"))
    trainer.train_step()
    trainer.train_step()  # the check runs at step 0 only
    assert len(seen) == 1 and seen[0].problem is None, seen
    assert seen[0].prompts_with_media == 4 and min(seen[0].figures.values()) > media_check.READS_MEDIA_BOUND
    assert "media check" not in capsys.readouterr().err


def test_a_pass_is_remembered_and_the_same_run_again_skips_the_check(tmp_path, monkeypatch, capsys):
    """A check that passed is remembered in the compile cache folder; a second run of the same
    recipe from the same checkpoint files skips it in one line. A checkpoint file written since,
    or other prompts, run it again; a failed check is never remembered; a random-init model
    (no files to key) is always checked."""
    import os

    from mmrl.trainer import Trainer

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    marks = tmp_path / "cache" / media_check.PassMemo.FOLDER
    first = Trainer(_vlm_recipe(tmp_path))
    first.built.save(tmp_path / "ckpt")
    saved = [f"model.path={tmp_path / 'ckpt'}", "model.random_init=false", "model.config_overrides={}"]

    def step(name, *extra):
        trainer = Trainer(_vlm_recipe(tmp_path, f"trainer.output_dir={tmp_path / name}", *saved, *extra))
        trainer.train_step()
        lines = [line for line in capsys.readouterr().err.splitlines() if "media check" in line]
        return trainer.timings["media_check_training"], lines

    first.train_step()  # random init: checked, nothing remembered
    assert first.timings["media_check_training"] > 0 and not marks.exists()
    seconds, lines = step("a")
    assert seconds > 0 and lines == [] and len(list(marks.iterdir())) == 1
    seconds, lines = step("b")
    assert seconds == 0 and len(lines) == 1, lines
    assert lines[0].startswith("step 0 media check: passed before on the same checkpoint files, recipe, prompts")
    assert lines[0].endswith(f"(delete {next(marks.iterdir())} to run it)")
    weights = tmp_path / "ckpt" / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    seconds, lines = step("c")
    assert seconds > 0 and lines == [] and len(list(marks.iterdir())) == 2
    seconds, _ = step("d", "data.train=synthetic:count_shapes?n=16&seed=1&image_size=56")
    assert seconds > 0 and len(list(marks.iterdir())) == 3
    _zeroed_pixels(monkeypatch)
    seconds, lines = step("e", "data.train=synthetic:count_shapes?n=16&seed=2&image_size=56")
    assert seconds > 0 and len(lines) == 1 and lines[0].startswith("warning:") and len(list(marks.iterdir())) == 3


def test_the_pass_key_follows_the_pixels_and_a_file_s_stamp(tmp_path):
    from PIL import Image

    memo = media_check.PassMemo(tmp_path, "base")
    image = Image.new("RGB", (8, 8), (1, 2, 3))

    def prompt(payload):
        return [[{"role": "user", "content": [{"type": "image", "image": payload}, {"type": "text", "text": "n?"}]}]]

    key = memo.key(prompt(image))
    assert key == memo.key(prompt(image.copy())) != memo.key(prompt(Image.new("RGB", (8, 8), (1, 2, 4))))
    assert key != media_check.PassMemo(tmp_path, "other").key(prompt(image))
    assert memo.key(prompt(torch.zeros(2, 3))) == memo.key(prompt(torch.zeros(2, 3))) != memo.key(prompt(torch.ones(2, 3)))
    path = tmp_path / "a.png"
    image.save(path)
    on_file = memo.key(prompt(str(path)))
    assert on_file == memo.key(prompt(str(path)))
    image.resize((9, 9)).save(path)
    assert memo.key(prompt(str(path))) != on_file
    # An object without a stable text (its address) gives a key no other object meets.
    assert memo.key(prompt(object())) != memo.key(prompt(object()))
    assert memo.passed(key) is None
    memo.remember(key)
    assert memo.passed(key) == tmp_path / f"{key}.passed"


def test_check_prompts_takes_a_shuffle_pair_then_one_of_each_other_shape():
    from PIL import Image

    def prompt(size):
        content = [{"type": "text", "text": "count"}]
        if size:
            content.insert(0, {"type": "image", "image": Image.new("RGB", (size, size))})
        return [{"role": "user", "content": content}]

    sizes = [32, 0, 48, 48, 64, 48, 80, 32, 96]
    batch = [prompt(size) for size in sizes]
    # 48 has the most prompts: two of them (a shuffle pair), then 32, 64, 80, 96 in turn.
    assert media_check.check_prompts(batch, 4) == [0, 2, 3, 4]
    assert media_check.check_prompts(batch, 6) == [0, 2, 3, 4, 6, 8]
    assert media_check.check_prompts(batch, 99) == [0, 2, 3, 4, 5, 6, 7, 8]  # every prompt with media
    assert media_check.check_prompts([prompt(0), prompt(0)], 4) == []
    # No two of one size: one of each, none paired.
    assert media_check.check_prompts([prompt(16), prompt(24), prompt(40)], 2) == [0, 1]


def test_step_zero_reads_at_most_its_limit_of_prompts(tmp_path, monkeypatch):
    """A first batch of 8 prompts with images: the step-0 check reads 4 of them (a pair of
    one size among them, so the shuffled variant moves pixels) and passes."""
    from mmrl.trainer import Trainer

    seen = []
    plain = media_check.step_zero_media_check
    monkeypatch.setattr("mmrl.trainer.step_zero_media_check", lambda *a, **k: seen.append(plain(*a, **k)) or seen[-1])
    trainer = Trainer(_vlm_recipe(tmp_path, "trainer.strict_media=true", "data.prompts_per_step=8"))
    trainer.train_step()
    assert trainer.timings["media_check_rollout"] + trainer.timings["media_check_training"] <= \
        trainer.timings["media_check"]
    assert len(seen) == 1 and seen[0].problem is None, seen
    assert seen[0].prompts_with_media == media_check.STEP_ZERO_PROMPTS == 4
    assert {"training/blank", "training/shuffled", "rollout/blank", "rollout/shuffled"} <= set(seen[0].figures)
    # Each path's seconds (processing and forwards), the step-0 metrics' time/media_check_* split.
    assert seen[0].seconds["rollout"] > 0 and seen[0].seconds["training"] > 0


def test_strict_media_is_validated(tmp_path):
    from mmrl.trainer import Trainer

    with pytest.raises(RecipeError, match=r"trainer\.strict_media: expected true or false, got 'maybe'"):
        _vlm_recipe(tmp_path, "trainer.strict_media=maybe")
    text = ["model.path=qwen2", "model.random_init=true", "data.train=synthetic:arithmetic?n=32&seed=0",
            "reward.name=numeric", f"trainer.output_dir={tmp_path / 'text'}", "trainer.strict_media=true"]
    with pytest.raises(RecipeError, match=r"^trainer\.strict_media: the model \(qwen2\) takes no images or video"):
        Trainer(load_recipe(None, text))
    with pytest.raises(RecipeError, match=r"^trainer\.strict_media: the step-0 media check runs on single-turn"):
        Trainer(_vlm_recipe(tmp_path, "trainer.strict_media=true", "rollout.env=single_turn"))
    with pytest.raises(RecipeError, match=r"^trainer\.strict_media: .* trainer\.media_check=false skips that check"):
        Trainer(_vlm_recipe(tmp_path, "trainer.strict_media=true", "trainer.media_check=false"))


def test_media_check_false_skips_the_step_zero_check(tmp_path, monkeypatch):
    from mmrl.trainer import Trainer

    calls = []
    monkeypatch.setattr("mmrl.trainer.step_zero_media_check", lambda *a, **k: calls.append(a))
    trainer = Trainer(_vlm_recipe(tmp_path, "trainer.media_check=false"))
    trainer.train_step()
    assert calls == [] and "media_check" not in trainer.timings


# -- on a GPU: the bf16 figures -------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["qwen2", "qwen2_5_vl", "gemma3", "smolvlm", "internvl"])
def test_rollout_agreement_records_its_bf16_figure_on_a_gpu(family):
    result = probe("rollout_agreement").run(_subject(family, "cuda"))
    print(f"{family}: {result.status} {result.reason}")
    assert result.evidence["precision"] == "bf16"
    assert {"hf", "hf_compiled"} <= set(result.evidence["backends"])
    assert result.status is Status.VERIFIED, result.reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_reads_media_on_a_gpu(family):
    result = probe("reads_media").run(_subject(family, "cuda"))
    assert result.status is Status.VERIFIED, result.reason
    assert "CompiledHFRollout" in result.reason  # the rollout a one-GPU run takes
