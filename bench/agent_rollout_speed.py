"""Multi-turn rollout speed: the zoom-tool agent (recipes/agent_zoom_count.yaml) at the
Qwen2.5-VL-3B shape, the compiled backend (`rollout.backend: hf_compiled`) against plain
`generate` (`hf`) on the same prompts and weights, in one process (issue 28).

    python bench/agent_rollout_speed.py --out $OUT/agent_rollout_speed_gpu.json
    python bench/agent_rollout_speed.py --out $OUT/b.json rollout.SOME_FLAG=true --agent-options SOME_FLAG=true
    .venv/bin/python bench/agent_rollout_speed.py --shape tiny --prompts 2 --samples 2 \
        --new-tokens 4 --repeats 1 --out /tmp/agent_rollout_speed.json   # smoke run on CPU
    .venv/bin/python bench/agent_rollout_speed.py --shape vl3b_host --new-tokens 8 --repeats 1 \
        --out /tmp/agent_rollout_host.json   # the host phases at the real image shape, on CPU
    python bench/agent_rollout_speed.py --repeats 1 --profile-prefill --profile-decode 20 \
        --out $OUT/agent_profile_gpu.json   # turn 2's prefill and decode steps under the profiler
    python bench/agent_rollout_speed.py --repeats 3 --profile-host \
        --out $OUT/agent_host_gpu.json      # turn 2's search for its new media under cProfile

The recipe's trainer is built once (`--shape vl3b`: the model config of
recipes/qwen2_5_vl_3b_shape.yaml, random bf16 weights, 448 x 448 images of 256 tokens;
`--shape tiny`: the recipe's own tiny model; `--shape vl3b_host`: the zoo's tiny
Qwen2.5-VL with the vl3b shape's images and pixel budget, so a CPU run times the host's
share of a turn, processing and inputs, at the real shape), with `rollout.backend=hf_compiled` and any
positional `key=value` recipe overrides, so a recipe option of the compiled or agent
rollout reaches the agent the trainer builds; `--agent-options key=value` (values read as
YAML) are then set on that agent and `--rollout-options` on its backend, for a flag that is
an attribute rather than a recipe key. The baseline is an `AgentRollout` over a plain
`hf` backend on the same engine, environment and limits.

Each sample has `--replies` + 1 policy turns of `--new-tokens` tokens each and
`--replies` image replies: the opening prompt (the question; the image hidden), a policy
turn, the environment's reply with the full image, a policy turn (three turns with one
image reply, by default). A random model never writes `zoom()` itself, so the environment
(`CallsZoom`) reads every policy turn within `max_calls` as that call; and the policy
samples only the digits 1-4 (every other token id blocked, on both backends), which
re-render as the same tokens, so no trajectory ends early by drift and every turn runs to
`--new-tokens` tokens (blocking the stop token too). Plain `generate` takes the blocked
ids as `suppress_tokens`, a mask over the vocabulary each step; the compiled loop adds a
prepared mask.

Both agents run once to warm up (the compiled one compiles), then `--repeats` alternating
rounds (bench/timing.py); per backend the median seconds per rollout, policy tokens/s
(the sampled tokens of every turn) and the trajectories' turns, image replies and finish
reasons, checked equal between the two; `speedup` is plain's seconds over compiled's.
`--variant KEY=VALUE ...` adds a third agent to the same rounds: the compiled backend built
again with those attributes (`runs["variant"]`, `variant_vs_compiled`: its median over the
compiled one's; `variant_speedup`: plain's over it), an A/B of a backend option with one
build and one baseline, e.g. `--variant prefill_layers=false`.
Per timed rollout, the seconds Python's collector took in it and its full collections
(`gc_s`, `gc_full`). Between the warm-up and the timed rounds the process freezes what it
holds (`gc.freeze`, as the trainer does after a step that compiled: `trainer.gc_freeze`);
`--no-gc-freeze` leaves it in the collector's reach.

After the timed rounds each agent runs once more with `timed=True` (mmrl/rollout/agent.py;
the session synchronizes the device at each phase's end, so these rounds are not in the
medians): `runs[name]["phases"]` lists per turn the rows, the backend call's seconds, the
environment's (`environment_s`) and the agent loop's own (`agent_s`), and on the compiled
side the session's phases: `batch` (how the turn's batch was made: "first", the openings;
"text", a later turn's ids put together from each row's last prompt and the new text
alone, mmrl/rollout/text_suffix.py; "rows", its rows processed whole), `process_s` (the
conversations processed on the host: templates, tokens, images), `inputs_s` (positions,
each row's suffix and its media cut out; `inputs_media_s` of it the suffixes' new media
found: each new image processed once per content, cut from the batch or joined),
`suffix_s` (a later turn's suffixes laid out: gathered, their positions, their media's
sharing, room made in the cache), `prefill_s`
(the prefill's forward, device), `decode_s` (the decode loop, device and host;
`decode_wait_s` of it the host waiting at its looks), `record_s` (tokens to the host,
the rows' records) and `rest_s`.
A table of them is printed.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from mmrl.envs.builtin import ToolEnvironment

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "agent_zoom_count.yaml"
SHAPE_RECIPE = REPO / "recipes" / "qwen2_5_vl_3b_shape.yaml"
ALLOWED = ("1", "2", "3", "4")  # the tokens the policy may sample (the recipe's answers)


class CallsZoom(ToolEnvironment):
    """The zoom-tool environment with every policy turn within `max_calls` read as a
    call of `zoom()` (what the recipe's trained policy writes), whatever was sampled."""

    def step(self, messages: list[dict]):
        if self.tool_calls < self.max_calls:
            messages = [*messages[:-1], {**messages[-1], "content": "zoom()"}]
        return super().step(messages)


def shape_overrides(shape: str, replies: int, new_tokens: int, prompts: int, samples: int, dtype: str) -> list[str]:
    """Recipe overrides of the agent recipe for `shape` and the turn layout."""
    # Each turn's tokens after the opening prompt: a policy turn and an image reply (256
    # tokens at 448 x 448, and its chat scaffolding).
    budget = (replies + 1) * new_tokens + replies * 300 + 64
    overrides = [f"rollout.max_turns={replies + 1}", f"rollout.env_options.max_calls={replies}",
                 f"rollout.max_new_tokens={new_tokens}", f"rollout.max_tokens={budget}",
                 f"data.prompts_per_step={prompts}", f"rollout.samples_per_prompt={samples}",
                 "rollout.backend=hf_compiled", "trainer.progress=false", "trainer.export=false",
                 "data.validation=null", "data.eval=null", "trainer.eval_every=0"]
    if shape in ("vl3b", "vl3b_host"):  # model.config_overrides: set by `recipe_for` (a mapping)
        model = yaml.safe_load(SHAPE_RECIPE.read_text())["model"]
        overrides += ["model.path=qwen2_5_vl", f"model.min_pixels={model['min_pixels']}",
                      f"model.max_pixels={model['max_pixels']}",
                      f"data.train=synthetic:count_shapes?n={max(prompts, 8)}&seed=0&image_size=448"]
        overrides += [f"model.dtype={dtype}"] if shape == "vl3b" else []
    else:
        overrides += [f"data.train=synthetic:count_shapes?n={max(prompts, 8)}&seed=0&image_size=56"]
    return overrides


def recipe_for(shape: str, overrides: list[str], given: list[str], folder: str):
    """The agent recipe with the bench's `overrides`, the shape's model config, then the
    caller's `given` overrides."""
    from mmrl.config import apply_overrides, read_recipe, validate_recipe

    values = apply_overrides(read_recipe(RECIPE), [*overrides, f"trainer.output_dir={folder}/run"])
    if shape == "vl3b":
        values["model"]["config_overrides"] = yaml.safe_load(SHAPE_RECIPE.read_text())["model"]["config_overrides"]
        values["model"]["tiny_vocabulary"] = values["model"].get("tiny_vocabulary") or {}
    elif shape == "vl3b_host":  # the zoo's tiny Qwen2.5-VL (the recipe's overrides are Qwen2-VL's)
        values["model"]["config_overrides"] = {}
    values = apply_overrides(values, given)
    return validate_recipe(values, where=RECIPE, folder=RECIPE.parent)


def key_values(pairs: list[str], what: str) -> dict:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"error: {what}: {pair!r} is not key=value")
        options[key] = yaml.safe_load(value)
    return options


def set_options(target, options: dict, what: str) -> None:
    """Attributes of `target` (an agent or a backend); one it does not have is an error,
    so a misspelt flag does not run the bench unchanged."""
    for key, value in options.items():
        if not hasattr(target, key) and key not in inspect.signature(type(target).__init__).parameters:
            raise SystemExit(f"error: {what}: {type(target).__name__} has no option {key!r}")
        setattr(target, key, value)


def only_sampling(processing, allowed: list[int], rows: int) -> None:
    """Make `processing` block every token id below `rows` but `allowed` (both backends read
    `blocked_token_ids`)."""
    blocked = sorted(set(range(rows)) - set(allowed))
    processing.__class__ = type(f"Only{type(processing).__name__}", (type(processing),),
                                {"blocked_token_ids": property(lambda self: blocked)})


def trajectory_stats(result) -> dict:
    trajectories = result.trajectories or []
    return {
        "trajectories": len(trajectories),
        "policy_tokens": sum(end - start for t in trajectories for start, end in t.spans),
        "turns": sorted({t.turns for t in trajectories}),
        "image_replies": sorted({t.tool_calls for t in trajectories}),
        "finish": sorted({t.finish for t in trajectories}),
        "sequence_tokens_max": max((len(t.prompt_ids) + len(t.last_ids) for t in trajectories), default=0),
    }


def main(argv: list[str] | None = None) -> dict:
    from timing import alternate  # bench/timing.py (bench/ is on the path of a bench script)

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["vl3b", "vl3b_host", "tiny"], default="vl3b")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="--shape vl3b: the weights (float32 runs under the engine's bf16 autocast)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens of each policy turn")
    parser.add_argument("--replies", type=int, default=1, help="image replies (policy turns: one more)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--agent-options", nargs="+", default=[], metavar="KEY=VALUE",
                        help="attributes set on the compiled backend's AgentRollout (values read as YAML)")
    parser.add_argument("--rollout-options", nargs="+", default=[], metavar="KEY=VALUE",
                        help="attributes set on the compiled backend (CompiledHFRollout)")
    parser.add_argument("--profile-prefill", action="store_true",
                        help="one more compiled rollout with each prefill forward under torch.profiler: its "
                             "kernels by group and the top ones (bench/decode_profile.py's table), per turn")
    parser.add_argument("--profile-decode", type=int, default=0, metavar="STEPS",
                        help="one more compiled rollout with STEPS decode steps of the last policy turn (from its "
                             "8th) under torch.profiler, the earlier steps timed (bench/decode_profile.py's StepProbe)")
    parser.add_argument("--profile-host", nargs="?", const="media", choices=["media", "rollout"],
                        help="one more compiled rollout under cProfile, the functions with the most cumulative "
                             "time: `media` (the default) the session's search for each later turn's new media "
                             "(its inputs_media phase: DecodeSession._continuation), `rollout` the whole rollout")
    parser.add_argument("--variant", nargs="+", default=[], metavar="KEY=VALUE",
                        help="a third agent in the same rounds: the compiled backend built again with these "
                             "attributes set (an A/B of a backend option in one process, one build)")
    parser.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                        help="leave what the warm-ups compiled in the collector's reach (the trainer freezes it "
                             "after a step that compiled: trainer.gc_freeze, mmrl/gc_watch.py)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "agent_rollout_speed_gpu.json")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides")
    args = parser.parse_args(argv)
    if args.profile_decode and args.profile_decode + PROFILE_FROM > args.new_tokens - 1:
        raise SystemExit(f"error: --profile-decode {args.profile_decode}: at most --new-tokens - {PROFILE_FROM + 1} "
                         f"({args.new_tokens - PROFILE_FROM - 1}), the last turn's decode steps from its {PROFILE_FROM}th")
    agent_options = key_values(args.agent_options, "--agent-options")
    rollout_options = key_values(args.rollout_options, "--rollout-options")
    variant_options = key_values(args.variant, "--variant")

    from mmrl.compile_watch import watch
    from mmrl.gc_watch import watch_gc
    from mmrl.platform_info import device_name, today, versions, write_report
    from mmrl.rollout import SamplingParams, make_rollout, rollout_options as recipe_rollout_options
    from mmrl.rollout.agent import AgentRollout
    from mmrl.trainer import Trainer

    overrides = shape_overrides(args.shape, args.replies, args.new_tokens, args.prompts, args.samples, args.dtype)
    with tempfile.TemporaryDirectory() as folder:
        recipe = recipe_for(args.shape, overrides, args.overrides, folder)
        began = time.perf_counter()
        trainer = Trainer(recipe)  # on the GPU where there is one (the trainer's own choice)
        build_s = time.perf_counter() - began
    device = trainer.dist.device
    r = recipe.rollout
    calls_zoom = functools.partial(CallsZoom, **r.env_options)
    compiled = trainer.agent
    compiled.env_factory = calls_zoom
    set_options(compiled, agent_options, "--agent-options")
    set_options(compiled.backend, rollout_options, "--rollout-options")
    plain = AgentRollout(make_rollout("hf", trainer.actor, trainer.processing), trainer.processing, calls_zoom,
                         max_turns=r.max_turns, max_tokens=r.max_tokens)
    tokenizer = trainer.processing.tokenizer
    allowed = [tokenizer.convert_tokens_to_ids(t) for t in ALLOWED]
    if any(i is None or i == tokenizer.unk_token_id for i in allowed):
        raise SystemExit(f"error: the tokenizer has no single tokens for {ALLOWED}")
    only_sampling(trainer.processing, allowed, trainer.actor.model.config.get_text_config().vocab_size)
    samples, _ = trainer.next_prompts()
    params = SamplingParams(n=r.samples_per_prompt, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                            top_p=r.top_p)
    agents = {"plain": plain, "compiled": compiled}
    if variant_options:
        backend = make_rollout("hf_compiled", trainer.actor, trainer.processing,
                               **recipe_rollout_options(r, "hf_compiled", compiled.backend.decode))
        set_options(backend, {**rollout_options, **variant_options}, "--variant")
        agents["variant"] = AgentRollout(backend, trainer.processing, calls_zoom, max_turns=compiled.max_turns,
                                         max_tokens=compiled.max_tokens, keep_cache=compiled.keep_cache)
        set_options(agents["variant"], agent_options, "--agent-options")
    stats: dict[str, list[dict]] = {name: [] for name in agents}
    warm_up: dict[str, float] = {}

    collections = watch_gc()

    def step(mode: str) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        collections.take()
        began = time.perf_counter()
        with torch.no_grad():
            result = agents[mode].generate(samples, params)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - began
        warm_up.setdefault(mode, seconds)
        gc_s, gc_full = collections.take()
        stats[mode].append({**trajectory_stats(result), "gc_s": gc_s, "gc_full": gc_full})
        return seconds

    def after_warm_up() -> None:
        # As the trainer does after a step that compiled (trainer.gc_freeze): later full
        # collections walk only what the rounds make, not the compiles' records.
        if args.gc_freeze:
            collections.freeze_after(watch().graphs)

    trainer.actor.model.eval()
    seconds, medians, peaks, failed = alternate(list(agents), step, args.repeats, device, free=lambda: None,
                                                after_warm_up=after_warm_up)
    phases = {name: timed_phases(agent, samples, params) for name, agent in agents.items() if name not in failed}
    runs = {}
    for name in agents:
        if name not in medians:
            continue
        timed = stats[name][1:]  # after the warm-up
        tokens = statistics.median(s["policy_tokens"] for s in timed)
        runs[name] = {"median_s": medians[name], "seconds": seconds[name], "warm_up_s": warm_up[name],
                      "gc_s": [s.pop("gc_s") for s in timed], "gc_full": [s.pop("gc_full") for s in timed],
                      "policy_tokens": tokens, "tokens_per_s": tokens / medians[name], "trajectories": timed[-1],
                      "peak_allocated_gib": peaks.get(name), "phases": phases.get(name)}
    runs["compiled"]["fallback"] = getattr(compiled.backend, "fallback_reason", None)
    if args.profile_prefill and "compiled" in runs:
        runs["compiled"]["prefill_profiles"] = profiled_prefills(compiled, samples, params, device)
    if args.profile_host and "compiled" in runs:
        runs["compiled"]["host_profile"] = profiled_host(compiled, samples, params, whole=args.profile_host == "rollout")
    if args.profile_decode and "compiled" in runs:
        runs["compiled"]["decode_profile"] = profiled_decode(compiled, samples, params, device, args.replies + 1,
                                                             args.profile_decode)
    # The last rollout's kept cache (mmrl/rollout/sessions.py; None with --agent-options
    # keep_cache=false): tokens prefilled against processing every turn whole.
    session = getattr(compiled, "session", None)
    runs["compiled"]["kept_cache"] = None if session is None else {
        key: session.stats[key] for key in ("prefill_tokens", "whole_tokens", "reprefilled_samples",
                                            "reprefill_reason", "turn_by_turn", "shared_openings",
                                            "shared_media_rows", "light_turns",
                                            "alone_positions", "text_turns")}
    report = {
        "command": "python bench/agent_rollout_speed.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": device_name(str(device)), "versions": versions(), "date": today(),
        "shape": args.shape, "dtype": args.dtype if args.shape == "vl3b" else recipe.model.dtype,
        "parameters": sum(p.numel() for p in trainer.actor.model.parameters()), "build_s": build_s,
        "prompts": args.prompts, "samples_per_prompt": r.samples_per_prompt, "new_tokens_per_turn": r.max_new_tokens,
        "image_replies": args.replies, "policy_turns": r.max_turns, "repeats": args.repeats,
        "recipe_overrides": [*overrides, *args.overrides], "agent_options": agent_options,
        "rollout_options": rollout_options, "variant_options": variant_options, "runs": runs, "failed": failed,
        "same_trajectory_shape": len(runs) == len(agents) and all(
            runs["plain"]["trajectories"][k] == run["trajectories"][k] for run in runs.values()
            for k in ("trajectories", "turns", "image_replies", "finish", "policy_tokens")),
    }
    if "variant" in runs and "compiled" in runs:
        report["variant_vs_compiled"] = runs["variant"]["median_s"] / runs["compiled"]["median_s"]
        report["variant_speedup"] = runs["plain"]["median_s"] / runs["variant"]["median_s"]
        print(f"variant ({args.variant}) {runs['variant']['median_s']:.3f} s against compiled "
              f"{runs['compiled']['median_s']:.3f} s: x{report['variant_vs_compiled']:.3f} "
              f"({report['variant_speedup']:.2f}x plain generate)", flush=True)
    if "plain" in runs and "compiled" in runs:
        report["speedup"] = runs["plain"]["median_s"] / runs["compiled"]["median_s"]
        print(f"plain {runs['plain']['median_s']:.2f} s/rollout ({runs['plain']['tokens_per_s']:.0f} tokens/s), "
              f"compiled {runs['compiled']['median_s']:.2f} s ({runs['compiled']['tokens_per_s']:.0f} tokens/s): "
              f"{report['speedup']:.2f}x; compiled warm-up {runs['compiled']['warm_up_s']:.1f} s, "
              f"fallback {runs['compiled']['fallback']}", flush=True)
        for name in runs:
            print(f"{name}: seconds {[round(x, 3) for x in runs[name]['seconds']]}, collector's seconds "
                  f"{[round(x, 3) for x in runs[name]['gc_s']]} (full {runs[name]['gc_full']})", flush=True)
    for name in runs:
        print_phases(name, runs[name]["phases"])
    decode = runs.get("compiled", {}).get("decode_profile")
    if decode:
        groups = ", ".join(f"{group} {values['us'] / 1e3:.2f}" for group, values in decode["groups"].items())
        print(f"decode step: {decode['step_ms']:.2f} ms (iteration {decode['iteration_ms']:.2f} ms); profiled "
              f"{decode['profiled_steps']} steps: kernels {decode['kernels_per_step']:.0f} a step, ms by group: {groups}",
              flush=True)
    host = runs.get("compiled", {}).get("host_profile")
    if host:
        what = "the whole rollout" if args.profile_host == "rollout" else "later turns' media search"
        print(f"{what} under cProfile: {host['calls']} call(s), {host['seconds'] * 1e3:.1f} ms", flush=True)
        for row in host["top"][:30 if args.profile_host == "rollout" else 15]:
            print(f"  {row['cumulative_ms']:8.1f} ms  {row['calls']:6d}  {row['function']}", flush=True)
    for call in runs.get("compiled", {}).get("prefill_profiles") or []:
        groups = ", ".join(f"{group} {values['us'] / 1e3:.1f}" for group, values in call["groups"].items())
        print(f"prefill {call['rows']} x {call['width']}: {call['ms']:.1f} ms; kernels {call['kernels_per_step']:.0f}, "
              f"ms by group: {groups}", flush=True)
    write_report(args.out, report)
    return report


def profiled_prefills(agent, samples: list, params, device: torch.device, top: int = 25) -> list[dict]:
    """One more rollout of the compiled `agent` with each prefill forward of its backend
    (`CompiledHFRollout.prefill`: a turn's, of every row it prefills) under `torch.profiler`:
    per call the rows and width of its ids, its milliseconds (the device synchronized
    around it) and `kernel_table`'s kernels by group and the top ones."""
    from decode_profile import _profiler, _synchronize, kernel_table  # bench/decode_profile.py

    backend, calls = agent.backend, []
    plain = backend.prefill

    def profiled(run, cache, inputs, positions, **options):
        _synchronize(device)
        profiler = _profiler(device)
        began = time.perf_counter()
        with profiler:
            logits = plain(run, cache, inputs, positions, **options)
            _synchronize(device)
        rows, width = inputs["input_ids"].shape
        calls.append({"rows": rows, "width": width, "ms": round((time.perf_counter() - began) * 1e3, 1),
                      **kernel_table(profiler, device, 1, top)})
        return logits

    backend.prefill = profiled
    try:
        with torch.no_grad():
            agent.generate(samples, params)
    finally:
        del backend.prefill  # the class's method again
    return calls


def profiled_host(agent, samples: list, params, top: int = 30, whole: bool = False) -> dict:
    """One more rollout of the compiled `agent` with each later turn's search for its new
    media (`DecodeSession._continuation`, the session's `inputs_media_s`) under cProfile, or
    the whole rollout (`whole`): its calls, their seconds and the functions with the most
    cumulative time in them."""
    import cProfile

    from mmrl.rollout import sessions

    profile, spent, calls = cProfile.Profile(), [0.0], [0]
    if whole:
        began = time.perf_counter()
        with torch.no_grad():
            profile.runcall(agent.generate, samples, params)
        spent[0], calls[0] = time.perf_counter() - began, 1
        return _profile_rows(profile, spent[0], calls[0], top)
    plain = sessions.DecodeSession._continuation

    def profiled(self, *args, **kwargs):
        began = time.perf_counter()
        profile.enable()
        try:
            return plain(self, *args, **kwargs)
        finally:
            profile.disable()
            spent[0] += time.perf_counter() - began
            calls[0] += 1

    sessions.DecodeSession._continuation = profiled
    try:
        with torch.no_grad():
            agent.generate(samples, params)
    finally:
        sessions.DecodeSession._continuation = plain
    return _profile_rows(profile, spent[0], calls[0], top)


def _profile_rows(profile, seconds: float, calls: int, top: int) -> dict:
    """A cProfile's `top` functions by cumulative time, with the profiled calls and seconds."""
    import pstats

    rows = [{"function": f"{Path(file).name}:{line}({name})", "calls": count, "cumulative_ms": round(cumulative * 1e3, 2)}
            for (file, line, name), (_, count, _, cumulative, _) in pstats.Stats(profile).stats.items()]  # type: ignore[attr-defined]
    rows.sort(key=lambda row: -row["cumulative_ms"])
    return {"calls": calls, "seconds": seconds, "top": rows[:top]}


# The last policy turn's decode steps profiled from this one on (`--profile-decode`).
PROFILE_FROM = 8


def profiled_decode(agent, samples: list, params, device: torch.device, turns: int, steps: int,
                    top: int = 25) -> dict:
    """One more rollout of the compiled `agent` with its decode step wrapped in
    bench/decode_profile.py's `StepProbe`: every step before the last policy turn's
    `PROFILE_FROM`th timed (CUDA events on a GPU), then `steps` steps under torch.profiler
    (kernels per step by group, the top ones). Every turn decodes `params.max_new_tokens` - 1
    steps here (the policy samples digits only, never the stop token)."""
    from decode_profile import StepProbe, kernel_table  # bench/decode_profile.py

    backend = agent.backend
    step = backend._compiled_step()
    probe = StepProbe(step, device, profile_from=(turns - 1) * (params.max_new_tokens - 1) + PROFILE_FROM,
                      profile_steps=steps)
    backend._step = probe  # what `_compiled_step` hands the decode loop
    try:
        with torch.no_grad():
            agent.generate(samples, params)
        probe.finish()
    finally:
        backend._step = step
    return {"profiled_steps": probe.profiled_steps, **probe.timings(),
            **kernel_table(probe.profiler, device, probe.profiled_steps, top=top)}


def timed_phases(agent, samples: list, params) -> list[dict]:
    """One more rollout of `agent` with per-turn timings (`AgentRollout.timed`), then
    timing off again."""
    agent.timed = True
    try:
        with torch.no_grad():
            agent.generate(samples, params)
        return agent.timings
    finally:
        agent.timed = False


PHASE_COLUMNS = ("generate_s", "process_s", "inputs_s", "inputs_media_s", "suffix_s", "prefill_s", "decode_s",
                 "decode_wait_s", "record_s", "rest_s", "environment_s", "agent_s")


def print_phases(name: str, turns: list[dict]) -> None:
    """A line per turn: rows, then each phase's milliseconds (- where the turn has none)."""
    print(f"{name}: per turn, ms   rows  " + "  ".join(c[:-2] for c in PHASE_COLUMNS), flush=True)
    for turn in turns:
        values = {**turn.get("session", {}), **turn}
        cells = [f"{1000 * values[c]:.0f}" if isinstance(values.get(c), float) else "-" for c in PHASE_COLUMNS]
        prefill, batch = turn.get("session", {}).get("prefill_rows"), turn.get("session", {}).get("batch")
        rows = f"{turn['rows']}" + (f" ({prefill} prefilled, {batch})" if prefill is not None else "")
        print(f"  turn {turn['turn']}: {rows}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
