"""bench/rollout_agreement_bf16.py on CPU: its split of the rollout_agreement figures (first
response token vs decode steps; with and without images) in fp32, where both sides agree
to rounding, and its text-only prompts."""

from bench_scripts import load_bench


def test_the_split_figures_agree_in_fp32_and_cover_every_backend():
    bench = load_bench("rollout_agreement_bf16")
    figures = bench.measure("qwen2_vl", "cpu", cpu_autocast=False, compile_layers="auto")
    assert figures["precision"] == "fp32"
    split = {k: v for k, v in figures.items() if isinstance(v, dict)}
    assert set(split) == {f"{b}/{p}" for b in ("hf", "hf_compiled") for p in ("sample", "text_only")}
    for f in split.values():
        assert max(f["max"], f["first_token_max"], f["later_tokens_max"]) <= 1e-4
        assert f["max"] == max(f["first_token_max"], f["later_tokens_max"])


def test_text_only_prompts_keep_the_text_and_drop_the_media():
    bench = load_bench("rollout_agreement_bf16")
    conversation = [{"role": "user", "content": [{"type": "image", "image": None}, {"type": "text", "text": "Hi"}]},
                    {"role": "user", "content": [{"type": "video", "video": None}]}]
    assert bench.text_only([conversation]) == [[{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                                                {"role": "user", "content": [{"type": "text", "text": "?"}]}]]
