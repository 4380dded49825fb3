"""Packed-sequence attention: the flash varlen kernel against dense causal SDPA over
length buckets, forward and backward, in one run.

The packed update (`bench/packing.py`) runs attention through torch's flash varlen kernel
(`mmrl.engine.varlen`), which on an H200 reached 93-134 TFLOP/s, against about 720 for
the update's matrix products. A causal sequence right-padded needs no mask (its real
tokens only see earlier ones), so the packed tokens can also be gathered into a few
dense (n, H, L, D) batches of sequences of similar length and run through
`scaled_dot_product_attention(is_causal=True)` on a chosen backend (cuDNN's Hopper
kernels among them), then scattered back; the `_kernel` modes time those SDPA calls alone,
on groups gathered beforehand. `buckets` picks the groups that minimize the
padded attention work for at most K groups. This bench measures whether that pays,
before the engine does it: the sequences of bench/packing.py (64, prompts 128-512,
responses 32-2048, 32768-token micro-batches), Qwen2.5-0.5B's heads (14 query heads, 2
key/value heads, head_dim 64), bf16. Each mode's output and gradients are compared with
varlen's; TFLOP/s count the causal work on real tokens (forward 2 x 2 x L^2/2 x H x D,
backward 2.5 x that).

    python bench/attention_kernels.py --out $OUT/attention_kernels_gpu.json
    .venv/bin/python bench/attention_kernels.py --device cpu --tiny --repeats 1 --backends math   # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# --backends names -> torch.nn.attention.SDPBackend members.
SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}


def buckets(lengths: list[int], most: int) -> list[list[int]]:
    """At most `most` groups of sequence indices, longest first, minimizing the padded
    causal work sum(len(group) * longest(group)^2); each group is a run of the lengths
    sorted longest first."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    sizes = [lengths[i] for i in order]
    n = len(sizes)
    most = max(1, min(most, n))
    inf = float("inf")
    # best[k][j]: least work covering the first j sequences with k groups.
    best = [[inf] * (n + 1) for _ in range(most + 1)]
    cut = [[0] * (n + 1) for _ in range(most + 1)]
    best[0][0] = 0.0
    for k in range(1, most + 1):
        for j in range(1, n + 1):
            for i in range(k - 1, j):
                work = best[k - 1][i] + (j - i) * sizes[i] ** 2
                if work < best[k][j]:
                    best[k][j], cut[k][j] = work, i
    k = min(range(1, most + 1), key=lambda k: best[k][n])
    groups, j = [], n
    while k:
        i = cut[k][j]
        groups.append(order[i:j])
        j, k = i, k - 1
    return groups[::-1]


class Bucketed:
    """Packed tokens (sequences end to end) laid out as dense right-padded (n, L) groups,
    per `buckets`. Each group's real tokens are copied into a zero buffer (`index_copy`:
    its backward is a gather) and read back with one `index_select` over all groups (its
    backward adds each real token's gradient once). A gather that read padding from a
    real token instead made the backward add tens of thousands of gradients into that one
    token, which dominated the first H200 run of this bench (27-230 ms against 2.7)."""

    def __init__(self, lengths: list[int], most: int, device: torch.device) -> None:
        starts = [0]
        for length in lengths:
            starts.append(starts[-1] + length)
        self.total = starts[-1]
        self.groups = []  # (token indices, their places in the (n * L) buffer, n, L)
        order = []
        for group in buckets(lengths, most):
            width = max(lengths[i] for i in group)
            tokens = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in group])
            places = torch.cat([row * width + torch.arange(lengths[i]) for row, i in enumerate(group)])
            self.groups.append((tokens.to(device), places.to(device), len(group), width))
            order.append(tokens)
        # Where each packed token sits in the groups' outputs laid end to end.
        self.back = torch.empty(self.total, dtype=torch.long)
        self.back[torch.cat(order)] = torch.arange(self.total)
        self.back = self.back.to(device)

    def padded_tokens(self) -> int:
        return sum(n * width for _, _, n, width in self.groups)

    def dense(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """(n, H, L, D) per group, zero past each sequence's end."""
        out = []
        for tokens, places, n, width in self.groups:
            buffer = tensor.new_zeros(n * width, *tensor.shape[1:])
            buffer = buffer.index_copy(0, places, tensor.index_select(0, tokens))
            out.append(buffer.view(n, width, *tensor.shape[1:]).transpose(1, 2))
        return out

    def attention(self, query, key, value, scale: float, backend) -> torch.Tensor:
        """(T, H, D) output of causal attention per sequence; `key`/`value` may have fewer
        heads (grouped-query attention)."""
        from torch.nn.attention import sdpa_kernel

        groups = query.shape[1] // key.shape[1]
        outs = []
        for (_, places, n, width), q, k, v in zip(self.groups, self.dense(query), self.dense(key),
                                                   self.dense(value)):
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            with sdpa_kernel(backend):
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            outs.append(o.transpose(1, 2).reshape(n * width, *query.shape[1:]).index_select(0, places))
        return torch.cat(outs).index_select(0, self.back)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="8 short sequences, small heads (smoke run)")
    parser.add_argument("--micro-batch-tokens", type=int, default=32768)
    parser.add_argument("--backends", nargs="+", default=["cudnn", "flash", "efficient"],
                        help="SDPA backends for the bucketed modes (torch.nn.attention.SDPBackend names, lower case)")
    parser.add_argument("--buckets", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "attention_kernels_gpu.json")
    args = parser.parse_args()

    from torch.nn.attention import SDPBackend

    from packing import lengths as rl_lengths  # bench/packing.py's RL lengths
    from mmrl.engine.packing import bins_by_tokens
    from mmrl.platform_info import device_name, versions, write_report

    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    count = 8 if args.tiny else 64
    prompts, responses = rl_lengths(count, generator, short=args.tiny)
    all_lengths = [p + r for p, r in zip(prompts, responses)]
    heads, kv_heads, dim = (4, 2, 16) if args.tiny else (14, 2, 64)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    scale = dim ** -0.5
    micro_batches = [[all_lengths[i] for i in rows]
                     for rows in bins_by_tokens(all_lengths, args.micro_batch_tokens)]

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def varlen(lengths):
        from torch.nn.attention.varlen import varlen_attn

        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        longest = max(lengths)
        import inspect

        # torch 2.11's kernel takes grouped key/value heads as they are; later ones ask for the flag.
        gqa = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}
        return lambda q, k, v: varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0), scale=scale,
                                           **gqa)

    def masked(lengths):
        """Reference where varlen is not available (CPU): SDPA over the block-diagonal causal mask."""
        document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
        mask = (document[:, None] == document[None, :]).tril()

        def run(q, k, v):
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
            out = torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(0, 1) for t in (q, k, v)), attn_mask=mask, scale=scale)
            return out.transpose(0, 1)
        return run

    reference = "varlen" if device.type == "cuda" else "masked"
    padded_tokens: dict[str, int] = {}  # per bucketed mode, over the micro-batches
    modes = {reference: lambda lengths: (varlen if reference == "varlen" else masked)(lengths)}
    for backend in args.backends:
        for most in args.buckets:
            def make(lengths, backend=backend, most=most, name=f"{backend}_{most}"):
                bucketed = Bucketed(lengths, most, device)
                padded_tokens[name] = padded_tokens.get(name, 0) + bucketed.padded_tokens()
                chosen = getattr(SDPBackend, SDPA_BACKENDS[backend])
                return lambda q, k, v: bucketed.attention(q, k, v, scale, chosen)
            modes[f"{backend}_{most}"] = make

    inputs = []
    for lengths in micro_batches:
        tokens = sum(lengths)
        q = torch.randn(tokens, heads, dim, device=device, dtype=dtype, generator=None)
        k = torch.randn(tokens, kv_heads, dim, device=device, dtype=dtype)
        v = torch.randn(tokens, kv_heads, dim, device=device, dtype=dtype)
        inputs.append((lengths, q, k, v, torch.randn_like(q)))

    def run(mode: str, functions) -> tuple[float, list]:
        synchronize()
        start = time.perf_counter()
        results = []
        for (lengths, q, k, v, grad), function in zip(inputs, functions):
            q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
            out = function(q_, k_, v_)
            out.backward(grad)
            results.append((out.detach(), q_.grad, k_.grad, v_.grad))
        synchronize()
        return time.perf_counter() - start, results

    work = sum(4 * n * n / 2 * heads * dim for lengths in micro_batches for n in lengths) * 3.5  # fwd + bwd
    report_modes, expected = {}, None
    for mode, make in modes.items():
        try:
            functions = [make(lengths) for lengths, *_ in inputs]
            _, results = run(mode, functions)  # warm-up, and the outputs to compare
            samples = [run(mode, functions)[0] for _ in range(args.repeats)]
        except Exception as error:  # a backend that cannot run these shapes here
            report_modes[mode] = {"failed": str(error).splitlines()[0][:200]}
            print(f"{mode:<14} failed: {report_modes[mode]['failed']}")
            continue
        if expected is None:
            expected = results
        gaps = [max((a - b).abs().max().item() for a, b in zip(ours, theirs))
                for ours, theirs in zip(results, expected)]
        median = statistics.median(samples)
        padded = padded_tokens.get(mode, sum(all_lengths))
        report_modes[mode] = {"median_ms": median * 1e3, "samples_ms": [s * 1e3 for s in samples],
                              "tflops": work / median / 1e12, "max_abs_diff_vs_reference": max(gaps),
                              "padded_tokens": padded}
    # The same SDPA calls on groups gathered beforehand (key/value heads already repeated):
    # what the kernels alone take, without the gather and scatter around them.
    for backend in args.backends:
        for most in args.buckets:
            name = f"{backend}_{most}_kernel"
            chosen = getattr(SDPBackend, SDPA_BACKENDS[backend])
            calls = []
            for lengths, q, k, v, _ in inputs:
                bucketed = Bucketed(lengths, most, device)
                groups = q.shape[1] // k.shape[1]
                for dq, dk, dv in zip(*(bucketed.dense(t) for t in (q, k, v))):
                    dk, dv = dk.repeat_interleave(groups, dim=1), dv.repeat_interleave(groups, dim=1)
                    calls.append(tuple(t.contiguous().requires_grad_() for t in (dq, dk, dv)) + (torch.randn_like(dq),))

            def kernels(calls=calls, chosen=chosen) -> float:
                from torch.nn.attention import sdpa_kernel

                synchronize()
                start = time.perf_counter()
                for q, k, v, grad in calls:
                    with sdpa_kernel(chosen):
                        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
                    out.backward(grad)
                synchronize()
                return time.perf_counter() - start
            try:
                kernels()
                samples = [kernels() for _ in range(args.repeats)]
            except Exception as error:
                report_modes[name] = {"failed": str(error).splitlines()[0][:200]}
                continue
            median = statistics.median(samples)
            report_modes[name] = {"median_ms": median * 1e3, "samples_ms": [s * 1e3 for s in samples],
                                  "tflops": work / median / 1e12, "max_abs_diff_vs_reference": None,
                                  "padded_tokens": padded_tokens.get(f"{backend}_{most}")}
    base = report_modes[reference].get("median_ms")
    print(f"{'mode':<14} {'median ms':>10} {'TFLOP/s':>8} {'vs ' + reference:>10} {'max diff':>9} {'tokens':>7}")
    for mode, row in report_modes.items():
        if "median_ms" in row:
            row["speedup_vs_reference"] = base / row["median_ms"] if base else None
            diff = "-" if row["max_abs_diff_vs_reference"] is None else f"{row['max_abs_diff_vs_reference']:.2e}"
            print(f"{mode:<14} {row['median_ms']:>10.2f} {row['tflops']:>8.0f} {row['speedup_vs_reference']:>10.2f} "
                  f"{diff:>9} {row['padded_tokens']:>7}")
    report = {"bench": "bench/attention_kernels.py", "device": device_name(str(device)), "versions": versions(),
              "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "dtype": str(dtype),
              "micro_batch_tokens": args.micro_batch_tokens, "micro_batches": [len(m) for m in micro_batches],
              "real_tokens": sum(all_lengths), "lengths": all_lengths, "reference": reference,
              "repeats": args.repeats, "modes": report_modes}
    write_report(args.out, report)


if __name__ == "__main__":
    main()
