"""bench/decode_profile.py on CPU: the trainer's rollout of a tiny model through the eager
and recorded-graphs steps (their eager twins here), 3 profiled decode steps each. The
timings mean nothing here; the report's fields, the operator census's facts and the
kernel-name groups do.

    .venv/bin/python -m pytest -q tests/test_bench_decode_profile.py
"""

import pytest
import torch

from bench_scripts import bench_report

BENCH_SCRIPT = "decode_profile"


@pytest.fixture(scope="module")
def report(bench, tmp_path_factory):
    return bench_report(bench, tmp_path_factory, [
        "--shape", "tiny", "--device", "cpu", "--no-compile", "--modes", "eager", "graphs", "--prompts", "2",
        "--samples", "2", "--new-tokens", "12", "--prompt-words", "5", "10", "--profile-from", "4",
        "--profile-steps", "3", "--top", "5"])


def test_each_mode_is_timed_profiled_and_described(report):
    assert report["errors"] == {} and list(report["modes"]) == ["eager", "graphs"]
    assert report["weights_dtype"] == "torch.bfloat16" and report["vocabulary"] == "tiny"
    assert "rollout.decode=graphs" in report["recipe_overrides"]
    for run in report["modes"].values():
        assert run["fallback"] is None and run["rows"] == 4 and run["decode_steps"] >= 7
        assert run["steps_timed"] == 3 and run["step_ms"] > 0 and run["iteration_ms"] > 0
        profile = run["profile"]
        assert run["profiled_steps"] == 3 and profile["kernels_per_step"] > 0 and len(profile["top"]) == 5
        assert {"matmul", "sampling"} <= set(profile["groups"])
        facts = run["facts"]
        # Both steps attend with mmrl's two batched products over the whole static cache.
        assert "batched matmuls, 2 score products" in facts["attention"] and facts["sdpa_calls"] == 0
        assert facts["attended_lengths"] == [facts["static_cache_length"]] == [256] == [facts["bucket_length"]]
        assert facts["needed_length"] == run["prompt_length"] + 12
        assert facts["repeat_kv_copies"] == 0 and facts["kv_heads"] == 2 and facts["query_heads"] == 4
        assert facts["lm_head"][0]["output"] == "torch.bfloat16"
        assert facts["logits_widened"] == ["torch.bfloat16 -> torch.float32"]
    assert report["modes"]["graphs"]["recorded"] == {"recordings": 0, "fallback": None,
                                                     "through_compiled_layers": False}  # CPU: nothing recorded


def test_the_census_finds_sdpa_and_grouped_query_copies(bench):
    """SDPA over keys copied out per query head (transformers' repeat_kv), as an eager
    grouped-query decode step without mmrl's attention would run it."""
    query, key = torch.randn(3, 4, 1, 16), torch.randn(3, 2, 40, 16)
    census = bench.OpCensus()
    with census:
        repeated = key[:, :, None].expand(3, 2, 2, 40, 16).reshape(3, 4, 40, 16)
        torch.nn.functional.scaled_dot_product_attention(query, repeated, repeated)
        (torch.randn(3, 64).to(torch.bfloat16) @ torch.randn(64, 100).to(torch.bfloat16)).float()
    facts = bench.step_facts(census.ops, vocab=100, heads=4, kv_heads=2, head_dim=16, cache_length=40, needed=30,
                             bucket=256)
    assert facts["attention"].startswith("sdpa ") and facts["sdpa_calls"] == 1
    assert facts["attended_lengths"] == [40] and facts["repeat_kv_copies"] == 1
    assert facts["lm_head"][0]["output"] == "torch.bfloat16"
    assert facts["logits_widened"] == ["torch.bfloat16 -> torch.float32"]  # not the weight's cast to bf16


@pytest.mark.parametrize("name, group", [
    ("nvjet_tst_128x64_64x4_1x2_h_bz_coopA_NTN", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<64, 64, 128, 4>>", "attention"),
    ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, false, false>", "attention"),
    ("triton_per_fused__softmax__to_copy_masked_fill_mul_2", "attention"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, Epilogue>", "sampling"),
    ("triton_red_fused__softmax_add_argmax_div_exponential_0", "sampling"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>", "sampling"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "elementwise"),
    ("triton_poi_fused_index_copy_0", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "elementwise"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>",
     "copy"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 4, 64, 64>", "copy"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
])
def test_kernel_names_fall_into_their_groups(bench, name, group):
    assert bench.kernel_group(name) == group


def test_a_profile_window_beyond_the_rollout_fails_in_one_line(bench, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--device", "cpu", "--shape", "tiny", "--new-tokens", "12", "--profile-from", "10",
                    "--out", str(tmp_path / "x.json")])
    assert str(exit_.value).startswith("error: --profile-from 10") and "\n" not in str(exit_.value)
