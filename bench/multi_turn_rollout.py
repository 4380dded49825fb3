"""Multi-turn rollout speed: the agent loop over plain `generate`, over the compiled rollout
re-prefilling each turn's whole conversation, and over the compiled rollout's kept cache
(mmrl/rollout/sessions.py), in one process.

A random-init VLM (default Qwen2.5-VL; `--shape 3b` gives its text decoder the 3B
checkpoint's shape, the vision tower stays the family's tiny one), `--prompts` prompts of
one image each, `--samples` samples per prompt, `--turns` policy turns with an image in
every environment reply, `--new-tokens` greedy tokens per turn (a random model rarely
stops, so every turn runs to the end). Each mode is warmed up on one full rollout
(compiling included, reported as warm_up_s), then `--repeats` alternating timed rollouts;
medians. The modes' trajectories are compared token by token with plain `generate`'s.

    python bench/multi_turn_rollout.py --shape 3b --out $OUT/multi_turn_rollout_gpu.json
    .venv/bin/python bench/multi_turn_rollout.py --device cpu --prompts 2 --samples 2 --new-tokens 6 \
        --repeats 1 --no-compile --out /tmp/multi_turn_rollout.json   # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# Qwen2.5-VL-3B-Instruct's text decoder (its config.json); mrope sections sum to head_dim / 2.
SHAPES = {
    "tiny": {},
    "3b": {"text_config": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                               num_attention_heads=16, num_key_value_heads=2, head_dim=128, vocab_size=151936,
                               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                "mrope_section": [16, 24, 24]}),
           "vision_config": {"out_hidden_size": 2048}},  # the merger feeds the text decoder's width
}
MODES = {"plain": ("hf", {}, True), "turn_by_turn": ("hf_compiled", {}, False),
         "kept_cache": ("hf_compiled", {}, True)}


class ImageReplies:
    """Every environment reply is a new image (a different shade each turn) and a word."""

    def __init__(self, role: str):
        self.role, self.calls = role, 0

    def reset(self, row):
        return [{"role": "user", "content": [{"type": "image", "image": row["image"]},
                                             {"type": "text", "text": row["text"]}]}]

    def step(self, messages):
        from PIL import Image

        self.calls += 1
        shade = 40 * self.calls % 256
        image = Image.new("RGB", (56 * (1 + self.calls % 2), 56), (shade, 255 - shade, 90))
        return [{"role": self.role, "content": [{"type": "image", "image": image},
                                                {"type": "text", "text": "ok"}]}], False, 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--family", default="qwen2_5_vl")
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="text decoder layers (default: the shape's)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="the static-cache loop without torch.compile")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "multi_turn_rollout_gpu.json")
    args = parser.parse_args()

    from PIL import Image

    from mmrl import build_model
    from mmrl.engine import Engine
    from mmrl.parallel import init_distributed
    from mmrl.platform_info import device_name, versions
    from mmrl.rollout import SamplingParams, make_rollout
    from mmrl.rollout.agent import AgentRollout

    dist = init_distributed(args.device)
    device = dist.device
    overrides = json.loads(json.dumps(SHAPES[args.shape]))
    if args.layers is not None:
        overrides.setdefault("text_config", {})["num_hidden_layers"] = args.layers
    with torch.device(device):
        built = build_model(args.family, random_init=True, seed=0, config_overrides=overrides or None,
                            processing_options={"min_pixels": 784, "max_pixels": 112 * 112})
    engine = Engine(built, dist)
    role = "tool" if args.family.startswith("qwen") else "user"
    rows = [{"image": Image.new("RGB", (56 + 28 * (i % 3), 56), (30 * i % 256, 80, 200)), "text": f"What is {i}?"}
            for i in range(args.prompts)]
    params = SamplingParams(n=args.samples, max_new_tokens=args.new_tokens, temperature=0)
    agents = {}
    for mode, (backend, options, keep) in MODES.items():
        if backend == "hf_compiled":
            options = {**options, "compile": not args.no_compile}
        rollout = make_rollout(backend, engine, built.processing, **options)
        agents[mode] = AgentRollout(rollout, built.processing, lambda: ImageReplies(role), max_turns=args.turns,
                                    max_tokens=args.turns * (args.new_tokens + 256), keep_cache=keep)

    def timed(agent):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = agent.generate(rows, params)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return result, time.perf_counter() - start

    report = {"device": device_name(str(device)), "versions": versions(), "family": args.family, "shape": args.shape,
              "layers": args.layers, "prompts": args.prompts, "samples": args.samples, "turns": args.turns,
              "new_tokens": args.new_tokens, "repeats": args.repeats, "compile": not args.no_compile,
              "command": "python bench/multi_turn_rollout.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                  if k not in ("out", "no_compile") and v is not None) + (" --no-compile" if args.no_compile else ""),
              "modes": {}}
    warm, seconds, results = {}, {mode: [] for mode in MODES}, {}
    for mode, agent in agents.items():
        results[mode], warm[mode] = timed(agent)
    for _ in range(args.repeats):
        for mode, agent in agents.items():
            results[mode], spent = timed(agent)
            seconds[mode].append(spent)
    reference = results["plain"].trajectories
    for mode, agent in agents.items():
        same = [a.ids == b.ids for a, b in zip(results[mode].trajectories, reference)]
        median = statistics.median(seconds[mode])
        session = agent.session.stats if agent.session is not None else None
        report["modes"][mode] = {
            "median_s": median, "seconds": seconds[mode], "warm_up_s": warm[mode],
            "speedup_over_plain": statistics.median(seconds["plain"]) / median,
            "trajectories_identical_to_plain": sum(same) / len(same),
            "fallback": getattr(agent.backend, "fallback_reason", None),
            "prefill_tokens": None if session is None else session["prefill_tokens"],
            "whole_tokens": None if session is None else session["whole_tokens"],
            "reprefill_reason": None if session is None else session["reprefill_reason"],
            "turn_by_turn": None if session is None else session["turn_by_turn"],
        }
        entry = report["modes"][mode]
        print(f"{mode}: {median:.2f} s ({entry['speedup_over_plain']:.2f}x plain), warm-up {warm[mode]:.1f} s, "
              f"identical {entry['trajectories_identical_to_plain']:.2f}, prefilled {entry['prefill_tokens']} of "
              f"{entry['whole_tokens']} tokens, fallback {entry['fallback']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
