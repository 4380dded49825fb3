"""bench/attention_kernels.py on CPU: the length buckets are the least padded work, and
causal attention over dense right-padded buckets equals the packed sequences' attention
(values and gradients, grouped key/value heads included)."""

import itertools
import json
import random
import sys

import torch

from bench_scripts import BENCH, load_bench


def _work(lengths, groups):
    return sum(len(g) * max(lengths[i] for i in g) ** 2 for g in groups)


def test_buckets_cover_every_sequence_once_with_the_least_padded_work():
    bench = load_bench("attention_kernels")
    rng = random.Random(0)
    for _ in range(20):
        lengths = [rng.randint(1, 50) for _ in range(rng.randint(1, 7))]
        most = rng.randint(1, 4)
        groups = bench.buckets(lengths, most)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths))) and len(groups) <= most
        # Every split of the longest-first order into at most `most` runs does no better.
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        best = min(_work(lengths, [order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))])
                   for k in range(min(most, len(order)))
                   for cuts in itertools.combinations(range(1, len(order)), k))
        assert _work(lengths, groups) == best


def test_bucketed_causal_attention_equals_the_packed_sequences_attention():
    bench = load_bench("attention_kernels")
    from torch.nn.attention import SDPBackend

    torch.manual_seed(0)
    lengths, heads, kv_heads, dim = [5, 1, 9, 3, 7], 4, 2, 8
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, dim, requires_grad=True) for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(total, heads, dim)
    document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = (document[:, None] == document[None, :]).tril()
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=mask).transpose(0, 1)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    for most in (1, 2, 5):
        out = bench.Bucketed(lengths, most, torch.device("cpu")).attention(q, k, v, dim ** -0.5, SDPBackend.MATH)
        torch.testing.assert_close(out, expected)
        for ours, theirs in zip(torch.autograd.grad(out, (q, k, v), grad), expected_grads):
            torch.testing.assert_close(ours, theirs)


def test_the_smoke_run_compares_every_mode_with_the_reference(tmp_path, monkeypatch):
    out = tmp_path / "attention.json"
    monkeypatch.syspath_prepend(str(BENCH))  # the bench imports bench/packing.py's lengths
    monkeypatch.setattr(sys, "argv", ["attention_kernels.py", "--device", "cpu", "--tiny", "--repeats", "1",
                                      "--backends", "math", "--buckets", "1", "3", "--out", str(out)])
    load_bench("attention_kernels").main()
    report = json.loads(out.read_text())
    assert report["reference"] == "masked"
    assert set(report["modes"]) == {"masked", "math_1", "math_3", "math_1_kernel", "math_3_kernel"}
    for name, mode in report["modes"].items():
        assert mode["padded_tokens"] >= report["real_tokens"] and mode["median_ms"] > 0
        if not name.endswith("_kernel"):  # the kernel-only modes time pre-gathered groups: nothing to compare
            assert mode["max_abs_diff_vs_reference"] < 1e-4
