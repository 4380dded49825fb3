"""bench/trl_grpo_step.py on CPU: the mmrl side of the end-to-end comparison (TRL is not
installed in CI's environment), its shared reward and its ratio arithmetic."""

import argparse
import json

import pytest

BENCH_SCRIPT = "trl_grpo_step"


def test_reward_counts_ascii_letters(bench):
    assert bench.letters_share(["ab1 ", "", "é!"], ["", "", ""]) == [0.5, 0.0, 0.0]
    conversational = [[{"role": "assistant", "content": "abcd"}], [{"role": "assistant", "content": "1"}]]
    assert bench.trl_reward(None, conversational) == [1.0, 0.0]


def test_ratios_are_against_the_fastest_trl_run(bench):
    runs = {"mmrl_fast": {"steps_done": 3, "median_s": {"step": 2.0}, "layer0_elements_changed": 0.02},
            "mmrl_compiled_fp32": {"steps_done": 3, "median_s": {"step": 4.0}, "layer0_elements_changed": 0.99},
            "trl": {"steps_done": 3, "median_s": {"step": 10.0}},
            "trl_bf16": {"steps_done": 3, "median_s": {"step": 8.0}},
            "mmrl_plain": {"steps_done": 1, "median_s": {"step": 1.0}}}  # one step: no warm median, left out
    comparison = bench.compare(runs, bench.RUNS)
    assert comparison["baseline"] == "trl_bf16"
    assert comparison["ratio_vs_baseline"] == {"mmrl_fast": 4.0, "mmrl_compiled_fp32": 2.0, "trl": 0.8,
                                               "trl_bf16": 1.0}
    assert comparison["ratio_vs_trl"]["mmrl_fast"] == 5.0
    assert comparison["best_learning_mmrl"] == "mmrl_compiled_fp32"  # mmrl_fast's updates barely moved it


def test_mmrl_side_runs_one_step_on_a_saved_tiny_model(bench, tmp_path):
    # The recipe names the reward trl_grpo_step:letters_share: the `bench` fixture holds bench/ on the path.
    args = argparse.Namespace(device="cpu", shape="tiny", vocabulary="auto", steps=1, new_tokens=4, prompts=2,
                              samples=4, prompt_words=[5, 10], lr=1e-6, seed=0, worker="mmrl_plain")
    start = bench.build_start(tmp_path / "model", args)
    assert start["tokenizer_size"] == start["vocab_rows"] == 1000
    assert len(start["first_prompt_ids"]) == 2 and all(8 <= n <= 40 for n in start["first_step_prompt_tokens"])

    result = tmp_path / "mmrl_plain.json"
    bench.run_mmrl(tmp_path / "model", args, bench.RUNS["mmrl_plain"]["overrides"], result)
    report = json.loads(result.read_text())
    (step,) = report["steps"]
    assert step["step_s"] > 0 and step["rollout_s"] > 0 and step["update_s"] > 0
    assert 0 < step["response_length"] <= 4
    assert step["optimizer_steps"] == 1 and step["micro_batches"] == 1
    assert report["weights_dtype"] == "float32" and report["rollout_backend"] == "hf"
    assert report["layer0_elements_changed"] > 0.5  # fp32 weights: a 1e-6 AdamW step moves them
    summary = bench.summarize(report, args)
    assert summary["tokens_per_s"] == pytest.approx(2 * 4 * 4 / step["step_s"])
