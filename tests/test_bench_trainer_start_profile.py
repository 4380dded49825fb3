"""bench/trainer_start_profile.py on the CPU: a run's and its compile helper's start under
cProfile, then steps with their garbage-collection seconds."""

import json
from pathlib import Path

import pytest

from bench_scripts import load_bench

REPO = Path(__file__).resolve().parents[1]
trainer_start_profile = load_bench("trainer_start_profile")
TINY = str(REPO / "recipes" / "tiny_vlm_count.yaml")
SMALL = ["data.train=synthetic:count_shapes?n=8&seed=0&image_size=56", "data.validation=null", "data.eval=null",
         "data.prompts_per_step=2", "trainer.threads=1"]


@pytest.mark.parametrize("helper", [False, True])
def test_the_profile_names_the_start_and_times_each_steps_collections(tmp_path, helper):
    out = tmp_path / "start.json"
    trainer_start_profile.main([TINY, *SMALL, "--steps", "1", "--top", "20", "--out", str(out),
                                *(["--helper"] if helper else ["--profile-first-step"])])
    report = json.loads(out.read_text())
    assert report["which"] == ("compile helper" if helper else "run") and report["start_s"] > 0
    assert any("trainer.py" in row["function"] and "__init__" in row["function"] for row in report["top"])
    assert len(report["top"]) == 20
    (step,) = report["steps"]
    assert step["step_s"] > 0 and step["gc_s"] >= 0 and step["gc_full"] >= 0 and "update" in step
    assert report["after_steps"]["objects"] > 0
    if not helper:  # --profile-first-step: step 1's functions, the media check's among them
        names = [row["function"] for row in report["first_step_top"]]
        assert len(names) == 20 and any("train_step" in name for name in names)
