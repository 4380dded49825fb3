"""bench/trl_grpo_step.py on CPU: the mmrl side of the end-to-end comparison (TRL is not
installed in CI's environment), its shared reward, its ratio and compile arithmetic, and the
geometry3k rows (`--rows geometry3k`) reaching mmrl at their own sizes."""

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


def test_mmrl_side_runs_one_step_on_a_saved_tiny_model(bench, tmp_path, monkeypatch):
    # The recipe names the reward trl_grpo_step:letters_share: the `bench` fixture holds bench/ on the path.
    monkeypatch.setenv("BENCH_PROFILE_FIRST_STEP", "1")  # the first step under cProfile, in the JSON
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
    profile = report["first_step_profile"]
    assert report["first_step_profiled"] and any("(train_step)" in row[0] for row in profile["cumulative"])
    assert all(a[3] >= b[3] for a, b in zip(profile["cumulative"], profile["cumulative"][1:]))
    assert all(a[2] >= b[2] for a, b in zip(profile["own"], profile["own"][1:]))
    assert report["first_loop_stats"] == {}  # plain generate keeps no loop stats
    assert all(x > 0 for x in report["first_step_full_gc_s"])


def test_compile_fields_count_what_compiled_after_the_first_step(bench):
    records = [{"step_s": 30.0, "compile_s": 20.0, "compile_graphs": 8},
               {"step_s": 2.0, "compile_s": 0.0, "compile_graphs": 0},
               {"step_s": 8.0, "compile_s": 6.0, "compile_graphs": 1},
               {"step_s": 2.0, "compile_s": 0.0, "compile_graphs": 0}]
    assert bench.compiles(records) == {"compile_graphs_after_first": 1, "compile_s_after_first": 6.0,
                                       "compile_share": round(26.0 / 42.0, 4), "compile_steps_after_first": [3]}
    assert bench.compiles([{"step_s": 9.0}, {"step_s": 8.0}]) == {}  # TRL's run counts no compiles
    # Waiting for the compile helper is compiling too.
    helped = [{**records[0], "compile_s": 2.0, "compile_helper_wait_s": 12.0}, *records[1:]]
    assert bench.compiles(helped)["compile_share"] == round(20.0 / 42.0, 4)
    assert bench.compiles(helped)["compile_helper_wait_s"] == 12.0


def test_rows_take_a_vision_language_shape():
    import subprocess
    import sys

    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(repo / "bench" / "trl_grpo_step.py"), "--device", "cpu", "--shape",
                           "tiny", "--rows", "geometry3k", "--runs", "mmrl_plain"], capture_output=True, text=True,
                          cwd=repo)
    assert proc.returncode == 2 and "--rows geometry3k: takes a vision-language shape" in proc.stderr


@pytest.mark.slow
def test_geometry3k_rows_reach_mmrl_at_their_own_sizes(bench, tmp_path):
    # `--shape tiny_vl --rows geometry3k`, the mmrl side (TRL is not in CI's environment): the
    # recipe's bundled rows and pixel budget, 2 steps of 2 prompts x 2 samples x 2 tokens.
    args = argparse.Namespace(device="cpu", shape="tiny_vl", vocabulary="auto", rows="geometry3k", steps=2,
                              new_tokens=2, prompts=2, samples=2, micro_batch=0, prompt_words=[10, 20], lr=1e-6,
                              seed=0, worker="mmrl_vl")
    start = bench.build_start(tmp_path / "model", args)
    (tmp_path / "start.json").write_text(json.dumps(start))
    assert start["rows"] == "geometry3k" and start["distinct_rows"] == 8  # train, validation and test rows
    # saved as a real Qwen checkpoint names its tokenizer (loaded once, through AutoProcessor)
    assert json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"
    rows = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    content = rows[0]["prompt"][0]["content"]
    assert content[0] == {"type": "image"} and content[1]["text"].endswith("MUST BE put in \\boxed{}.")
    planned = start["first_steps"]
    assert len(planned) == 2
    sizes = {tuple(size) for step in planned for size in step["image_sizes"]}
    assert len(sizes) >= 2  # the diagrams' own shapes, resized within the recipe's budget
    assert all(h % 28 == 0 and w % 28 == 0 and h * w >= 512 * 512 for h, w in sizes)
    tokens = [n for step in planned for n in step["prompt_tokens"]]
    assert len(set(tokens)) > 1 and min(tokens) > 300  # ~330+ image tokens each, texts of their own lengths

    result = tmp_path / "mmrl_vl.json"
    bench.run_mmrl(tmp_path / "model", args, ["rollout.backend=hf", "model.dtype=float32"], result)
    report = json.loads(result.read_text())
    assert report["first_steps"] == planned and report["first_steps_equal_plan"] is True
    summary = bench.summarize(report, args)
    assert summary["steps_done"] == 2
    for field in ("compile_total_s", "compile_graphs_total", "compile_graphs_after_first", "compile_s_after_first",
                  "compile_share"):
        assert summary[field] is not None and summary[field] >= 0
    assert 0 <= summary["compile_share"] <= 1
    assert all("compile_s" in step and "compile_graphs" in step for step in summary["per_step"])


def _decode_ab(tmp_path, **env):
    """bench/decode_ab.sh on the geometry3k rows at the VL-3B shape, with a stand-in
    interpreter that writes each run's arguments (and its switches) into the run's log and
    the wheels' imports into $OUT/imports (no GPU here)."""
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    python = tmp_path / "python"
    python.write_text('#!/bin/bash\n[[ $1 == -c ]] && { echo "$2" >> "$OUT/imports"; exit 0; }\n'
                      'echo "views=$MMRL_DECODE_LAYER_VIEWS,profiled=$BENCH_PROFILE_FIRST_STEP $*"\n')
    python.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k != "GRAPHS_CACHE"}
    proc = subprocess.run(["bash", str(repo / "bench" / "decode_ab.sh")], capture_output=True, text=True,
                          env={**base, "OUT": str(tmp_path), "PYTHON": str(python), "ROWS": "geometry3k",
                               "SHAPE": "vl3b", **env})
    assert proc.returncode == 0, proc.stderr


def test_decode_ab_passes_the_rows_and_runs_trl_on_them(tmp_path):
    _decode_ab(tmp_path, MODES="graphs prewarm noviews nofreeze warm_profiled trl")
    assert "trl" in (tmp_path / "imports").read_text()  # the trl mode needs TRL's carried wheels
    graphs = (tmp_path / "decode_graphs_vl3b_geometry3k.log").read_text().split()
    trl = (tmp_path / "decode_trl_vl3b_geometry3k.log").read_text().split()
    for args in (graphs, trl):
        assert args[args.index("--rows") + 1] == "geometry3k" and args[args.index("--steps") + 1] == "50"
    assert "--variant" in graphs and graphs[graphs.index("--runs") + 1] == "--variant"
    # prewarm: the graphs run with the compile helper on, the rest alike
    prewarm = (tmp_path / "decode_prewarm_vl3b_geometry3k.log").read_text().split()
    assert prewarm[prewarm.index("--variant") + 1] == "mmrl_graphs_prewarm" and "model.compile_prewarm=true" in prewarm
    assert [a for a in prewarm if a not in ("mmrl_graphs_prewarm", "model.compile_prewarm=true")] == \
        [a.replace("decode_graphs", "decode_prewarm") for a in graphs if a != "mmrl_graphs"]
    # noviews: the graphs run with the cache write outside the layers' graphs, the rest alike
    noviews = (tmp_path / "decode_noviews_vl3b_geometry3k.log").read_text().split()
    assert graphs[0] == "views=1,profiled=0" and noviews[0] == "views=0,profiled=0"
    assert [a for a in noviews[1:] if a != "mmrl_graphs_noviews"] == \
        [a.replace("decode_graphs", "decode_noviews") for a in graphs[1:] if a != "mmrl_graphs"]
    # nofreeze: the graphs run without trainer.gc_freeze, the rest alike
    nofreeze = (tmp_path / "decode_nofreeze_vl3b_geometry3k.log").read_text().split()
    assert nofreeze[nofreeze.index("--variant") + 1] == "mmrl_graphs_nofreeze" and "trainer.gc_freeze=false" in nofreeze
    assert [a for a in nofreeze if a not in ("mmrl_graphs_nofreeze", "trainer.gc_freeze=false")] == \
        [a.replace("decode_graphs", "decode_nofreeze") for a in graphs if a != "mmrl_graphs"]
    # warm_profiled: graphs' cache again, its first step under cProfile, the rest alike
    profiled = (tmp_path / "decode_warm_profiled_vl3b_geometry3k.log").read_text().split()
    assert profiled[0] == "views=1,profiled=1" and profiled[profiled.index("--variant") + 1] == "mmrl_graphs_warm_profiled"
    assert [a for a in profiled[1:] if a != "mmrl_graphs_warm_profiled"] == \
        [a.replace("decode_graphs", "decode_warm_profiled") for a in graphs[1:] if a != "mmrl_graphs"]
    assert trl[trl.index("--runs") + 1] == "trl" and trl[trl.index("--steps-for") + 1] == "trl=6"
    assert trl[trl.index("--whole-run") + 1] == "50"
    assert trl[trl.index("--out") + 1] == str(tmp_path / "decode_trl_vl3b_geometry3k.json")


def test_a_kept_start_is_reused_only_with_the_settings_it_was_built_with(bench, tmp_path):
    import argparse

    args = argparse.Namespace(device="cuda", shape="vl3b", rows="geometry3k", prompts=8, seed=0, vocabulary="auto",
                              prompt_words=[20, 60], prompt_steps=50, steps=3)
    assert bench.prompt_steps(args) == 50 and bench.prompt_steps(argparse.Namespace(steps=3)) == 3
    assert bench.kept_start(tmp_path, args) is None  # nothing kept yet
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "start.json").write_text(json.dumps({"parameters": 1, "signature": bench.start_signature(args)}))
    assert bench.kept_start(tmp_path, args)["parameters"] == 1
    args.steps = 50  # the run's own length is not the start's
    assert bench.kept_start(tmp_path, args) is not None
    args.seed = 1
    assert bench.kept_start(tmp_path, args) is None


def test_decode_ab_keeps_the_start_beside_a_named_graphs_cache(tmp_path):
    for cache in (str(tmp_path / "g"), None):
        _decode_ab(tmp_path, MODES="graphs_warm", **({"GRAPHS_CACHE": cache} if cache else {}))
        args = (tmp_path / "decode_graphs_warm_vl3b_geometry3k.log").read_text().split()
        if cache:
            assert args[args.index("--start-dir") + 1] == f"{cache}/start"
        else:
            assert "--start-dir" not in args


def test_first_steps_compare_over_the_steps_a_run_did(bench):
    planned = [{"prompt_tokens": [417, 429], "image_sizes": [[420, 644], [532, 532]]},
               {"prompt_tokens": [422, 429], "image_sizes": [[420, 644], [532, 532]]}]
    assert bench.same_steps(planned[:1], planned) and bench.same_steps(planned, planned)
    assert not bench.same_steps([], planned) and not bench.same_steps(None, planned)
    assert not bench.same_steps([{**planned[0], "image_sizes": [[532, 532], [532, 532]]}], planned)
    assert bench.spread_summary(planned) == {"prompt_tokens_min": 417, "prompt_tokens_max": 429,
                                             "image_sizes_distinct": [[420, 644], [532, 532]]}
