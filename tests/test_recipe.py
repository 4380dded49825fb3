"""README's main job: the tiny VLM counting recipe learns, and learns from the image.

Runs the recipe exactly as README.md gives it (about a minute on 2 quiet cores) and checks
the three figures it prints: held-out greedy accuracy, the majority-answer baseline and the
accuracy with images shuffled among the questions. The work is bounded by the recipe's
steps, not by wall time (a busy CI machine took 236 s once); its speed is measured by
bench/tiny_vlm_recipe.py.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_tiny_vlm_recipe_learns_to_count_from_the_image(tmp_path):
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "mmrl.cli", "train", "recipes/tiny_vlm_count.yaml", f"trainer.output_dir={tmp_path}",
         "trainer.progress=false"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    wall = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-3000:]
    final = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    print(f"wall {wall:.0f} s, {final}")
    assert final["final"]
    assert final["eval/accuracy"] >= 0.9
    assert final["eval/majority_baseline"] <= 0.35
    assert final["eval/shuffled_images_accuracy"] <= 0.4
    assert (tmp_path / "reward_curve.png").is_file() and (tmp_path / "final" / "model.safetensors").is_file()
