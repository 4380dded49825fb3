"""Can a memory-bound decode run beside a compute-bound update on one GPU? (issue 33)

    python bench/green_overlap.py --out $OUT/green_overlap_gpu.json     # on the GPU, ~60 s

One-step-off on one H200 measured 1.16x at best (docs/async.md): the decode's short
kernels wait behind the update's GEMMs, which fill every SM, even on a high-priority
stream. This bench asks whether splitting the SMs between the two with CUDA green
contexts (`torch.cuda.green_contexts`, beta) lets them overlap, before the trainer is
changed for it. Two synthetic workloads at the VL-3B shape, each recorded as a CUDA graph:

  decode   36 layers of a batch of 64 rows times bf16 weights (2048 -> 11008 -> 2048 and
           2048 -> 2560: what a decode step reads, about 6 GB a step): memory-bound
  update   GEMMs of 16,384 tokens at the same widths: compute-bound

each alone, then side by side from two threads (`--decode-steps` decode steps against
`--update-reps` update passes) as: plain streams, the decode on a high-priority stream, and
the two on green contexts of `--sms` SMs for the decode and the rest for the update; and
`one_thread*`: both sides enqueued from one thread (the update's passes, then the decode
steps), which tells whether the two Python threads or the GPU serialize them; `eager*`: the
two threads launch the same work op by op instead of replaying graphs; `green_balanced_*`:
green contexts whose work queues are their own (`workqueue_scope="balanced"`, torch 2.12+;
an older torch reports the mode as an error). `--modes` picks arrangements.
`overlap` is the two alone, one after the other, over the wall time side by side (2.0 would
be perfect overlap, 1.0 none).
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path


def build(device, dtype, layers: int, hidden: int, ffn: int, rows: int, tokens: int):
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    weights = [(torch.randn(hidden, ffn, device=device, dtype=dtype, generator=g) * 0.02,
                torch.randn(ffn, hidden, device=device, dtype=dtype, generator=g) * 0.02,
                torch.randn(hidden, hidden + 512, device=device, dtype=dtype, generator=g) * 0.02)
               for _ in range(layers)]
    x_decode = torch.randn(rows, hidden, device=device, dtype=dtype, generator=g)
    x_update = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=g)
    return weights, x_decode, x_update


def forward(weights, x):
    import torch

    for up, down, qkv in weights:
        h = torch.nn.functional.silu(x @ up) @ down
        x = (x + h + (x @ qkv)[:, : x.shape[1]]) * 0.5
    return x


def graphed(fn, stream):
    import torch

    with torch.cuda.stream(stream):
        fn()  # warm-up (cuBLAS workspaces)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    stream.synchronize()
    return graph


_KEPT = []  # the green contexts stay alive as long as their streams are used


class Eager:
    """The same work as a recorded graph's `replay()`, launched op by op from Python."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def green_streams(sms: int, balanced: bool = False):
    """(decode stream, update stream) on two green contexts splitting the SMs, or raises;
    `balanced`: each with work queues of its own (`workqueue_scope="balanced"`, torch 2.12+)."""
    import inspect

    import torch
    from torch.cuda.green_contexts import GreenContext

    total = torch.cuda.get_device_properties(0).multi_processor_count
    takes = inspect.signature(GreenContext.create).parameters
    if balanced and "workqueue_scope" not in takes:
        raise RuntimeError(f"this torch ({torch.__version__}) has no GreenContext workqueue_scope")
    made = []
    for count in (sms, total - sms):
        extra = {"workqueue_scope": "balanced"} if balanced else {}
        ctx = GreenContext.create(num_sms=count, device_id=0, **extra) if "num_sms" in takes \
            else GreenContext.create(count, 0)
        if hasattr(ctx, "Stream"):
            stream = ctx.Stream()
        else:  # torch 2.10/2.11: the context's stream is made current by set_context
            ctx.set_context()
            stream = torch.cuda.current_stream()
            ctx.pop_context()
        made.append((ctx, stream))
    _KEPT.extend(made)
    return made


BASE_MODES = ("plain", "priority", "one_thread", "one_thread_priority", "eager", "eager_priority")


def mode_names(sms: list[int]) -> list[str]:
    """Every arrangement the bench knows, in its order, for these green-context SM counts."""
    return [*BASE_MODES, *(name for count in sms for name in (f"green_{count}", f"green_balanced_{count}"))]


def chosen_modes(modes: list[str] | None, sms: list[int]) -> list[str]:
    """`--modes` checked against the known arrangements (all of them by default)."""
    known = mode_names(sms)
    unknown = [name for name in modes or () if name not in known]
    if unknown:
        raise SystemExit(f"--modes: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    return list(modes or known)


def run(args) -> dict:
    import torch

    chosen = chosen_modes(args.modes, args.sms)
    device = torch.device("cuda")
    dtype = torch.bfloat16
    weights, x_decode, x_update = build(device, dtype, args.layers, args.hidden, args.ffn, args.rows, args.tokens)
    total_sms = torch.cuda.get_device_properties(0).multi_processor_count

    def timed_side_by_side(decode_graph, update_graph, decode_stream, update_stream) -> dict:
        torch.cuda.synchronize()
        times = {}

        def side(name, graph, stream, reps):
            with torch.cuda.stream(stream):
                start = time.perf_counter()
                for _ in range(reps):
                    graph.replay()
                stream.synchronize()
                times[name] = time.perf_counter() - start

        threads = [threading.Thread(target=side, args=("decode", decode_graph, decode_stream, args.decode_steps)),
                   threading.Thread(target=side, args=("update", update_graph, update_stream, args.update_reps))]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        times["wall"] = time.perf_counter() - start
        return times

    def one_thread(decode_graph, update_graph, decode_stream, update_stream) -> dict:
        """Both sides enqueued from this thread (the update's passes first, then the decode
        steps), no second Python thread: whether the threads, not the GPU, serialize."""
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(update_stream):
            for _ in range(args.update_reps):
                update_graph.replay()
        with torch.cuda.stream(decode_stream):
            for _ in range(args.decode_steps):
                decode_graph.replay()
        decode_stream.synchronize()
        decode = time.perf_counter() - start
        update_stream.synchronize()
        wall = time.perf_counter() - start
        return {"decode": decode, "update": wall, "wall": wall}

    def alone(graph, stream, reps) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            for _ in range(reps):
                graph.replay()
        stream.synchronize()
        return time.perf_counter() - start

    report = {"device": torch.cuda.get_device_name(0), "sms": total_sms, "torch": torch.__version__,
              "settings": vars(args) | {"out": str(args.out)}, "modes": {}}
    configs = {"plain": lambda: (torch.cuda.Stream(), torch.cuda.Stream()),
               "priority": lambda: (torch.cuda.Stream(priority=-1), torch.cuda.Stream()),
               "one_thread": lambda: (torch.cuda.Stream(), torch.cuda.Stream()),
               "one_thread_priority": lambda: (torch.cuda.Stream(priority=-1), torch.cuda.Stream()),
               "eager": lambda: (torch.cuda.Stream(), torch.cuda.Stream()),
               "eager_priority": lambda: (torch.cuda.Stream(priority=-1), torch.cuda.Stream())}
    for sms in args.sms:
        configs[f"green_{sms}"] = lambda sms=sms: tuple(s for _, s in green_streams(sms))
        configs[f"green_balanced_{sms}"] = lambda sms=sms: tuple(s for _, s in green_streams(sms, balanced=True))
    assert list(configs) == mode_names(args.sms)  # one list of names
    for name in chosen:
        make = configs[name]
        try:
            decode_stream, update_stream = make()
            if name.startswith("eager"):  # launched op by op from the threads, no graphs
                decode_graph = Eager(lambda: forward(weights, x_decode))
                update_graph = Eager(lambda: forward(weights, x_update))
            else:
                decode_graph = graphed(lambda: forward(weights, x_decode), decode_stream)
                update_graph = graphed(lambda: forward(weights, x_update), update_stream)
            decode_alone = min(alone(decode_graph, decode_stream, args.decode_steps) for _ in range(2))
            update_alone = min(alone(update_graph, update_stream, args.update_reps) for _ in range(2))
            beside = one_thread if name.startswith("one_thread") else timed_side_by_side
            both = [beside(decode_graph, update_graph, decode_stream, update_stream) for _ in range(3)]
            best = min(both, key=lambda t: t["wall"])
            mode = {"decode_alone_s": decode_alone, "update_alone_s": update_alone,
                    "decode_beside_s": best["decode"], "update_beside_s": best["update"], "wall_beside_s": best["wall"],
                    "overlap": (decode_alone + update_alone) / best["wall"],
                    "decode_ms_per_step_alone": 1000 * decode_alone / args.decode_steps,
                    "decode_ms_per_step_beside": 1000 * best["decode"] / args.decode_steps}
        except Exception as error:  # noqa: BLE001 - a beta API: report and go on
            mode = {"error": f"{type(error).__name__}: {error}"[:300]}
        report["modes"][name] = mode
        shown = ", ".join(f"{k} {v:.3f}" for k, v in mode.items() if isinstance(v, float)) or mode.get("error")
        print(f"{name}: {shown}", flush=True)
        if args.out is not None:  # after every mode: a run stopped by its time limit keeps what it measured
            from mmrl.platform_info import write_report

            write_report(args.out, report)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--decode-steps", type=int, default=1000)
    parser.add_argument("--update-reps", type=int, default=8)
    parser.add_argument("--sms", type=int, nargs="+", default=[16, 32, 48])
    parser.add_argument("--modes", nargs="+", default=None,
                        help="which arrangements, in order (default: all; green_* and green_balanced_* per --sms)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/green_overlap_gpu.json"))
    run(parser.parse_args())  # writes --out after every mode


if __name__ == "__main__":
    main()
