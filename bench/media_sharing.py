"""Shared media encoding against the plain path, in one run: the same rollout's batches
timed with each prompt's images encoded once (`model.share_media`, mmrl/engine/media.py)
and with every sample encoding its own copy.

    .venv/bin/python bench/media_sharing.py [RECIPE] [key=value ...] [--repeats 5]
        [--out bench/results/media_sharing_cpu.json]
    # the Qwen2.5-VL-3B shape on a GPU:
    python bench/media_sharing.py recipes/qwen2_5_vl_3b_shape.yaml --out $OUT/media_sharing_gpu.json

One trainer is built from the recipe and one rollout made. Then, alternating the two
modes `--repeats` times, it times: building the micro-batches (processing, plus each
prompt's own media when sharing), the update pass (log-probs forward + backward over every
micro-batch, no optimizer step, so both modes see the same weights), a no-grad log-prob
pass (what the reference and old-policy passes cost) and an HF-generate rollout. Before
timing, it checks that the two modes give the same log-probs. Prints medians and the
plain/shared ratios, and writes them as JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PHASES = ("batches", "update", "logprob", "rollout")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default=str(REPO / "recipes" / "tiny_vlm_count.yaml"))
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "media_sharing_cpu.json")
    args = parser.parse_args()

    from mmrl.config import load_recipe
    from mmrl.data import to_conversation
    from mmrl.platform_info import device_name, versions, write_report
    from mmrl.rollout.base import SamplingParams
    from mmrl.rollout_batch import training_batches
    from mmrl.trainer import Trainer

    recipe = load_recipe(args.recipe, [*args.overrides, "trainer.progress=false", "model.share_media=true"])
    trainer = Trainer(recipe)
    actor, device = trainer.actor, trainer.dist.device
    if not actor.shares_media:
        raise SystemExit(f"{recipe.model.path}: this family does not share media encoding (nothing to compare)")
    r = recipe.rollout
    params = SamplingParams(n=r.samples_per_prompt, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                            top_p=r.top_p)
    conversations = [to_conversation(s) for s in trainer.next_prompts()[0]]
    result = trainer.rollout.generate(conversations, params)
    rows = torch.arange(len(result.response_ids))
    generator = torch.Generator().manual_seed(0)
    advantages = torch.randn(len(rows), 1, generator=generator).to(device)

    def run(share: bool, check: bool = False) -> dict[str, float]:
        actor.shares_media = share
        times = {}
        start = time.perf_counter()
        batches, _ = training_batches(conversations, result, rows, algo=recipe.algo, dist=trainer.dist,
                                      processing=trainer.processing, adapter=trainer.built.adapter, actor=actor)
        times["batches"] = time.perf_counter() - start
        _sync(device)
        start = time.perf_counter()
        offset, logps = 0, []
        for seqs in batches:
            logp, _ = actor.log_probs(seqs)
            weights = advantages[offset:offset + seqs.size]
            offset += seqs.size
            (-(logp * weights * seqs.response_mask).sum() / len(rows)).backward()
            logps.append(logp.detach().float().cpu())
        _sync(device)
        times["update"] = time.perf_counter() - start
        actor.optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with torch.no_grad():
            for seqs in batches:
                actor.log_probs(seqs, with_entropy=False)
        _sync(device)
        times["logprob"] = time.perf_counter() - start
        start = time.perf_counter()
        trainer.rollout.generate(conversations, params)
        _sync(device)
        times["rollout"] = time.perf_counter() - start
        if check:
            times["logps"] = logps
        return times

    # Warm-up, and the two modes compute the same thing.
    plain, shared = run(False, check=True), run(True, check=True)
    gap = max((a - b).abs().max().item() for a, b in zip(plain.pop("logps"), shared.pop("logps")))
    print(f"max |log-prob difference| shared vs plain: {gap:.2e}")
    samples: dict[str, dict[str, list[float]]] = {"plain": {p: [] for p in PHASES}, "shared": {p: [] for p in PHASES}}
    for _ in range(args.repeats):
        for mode in ("plain", "shared"):
            for phase, seconds in run(mode == "shared").items():
                samples[mode][phase].append(seconds)
    medians = {mode: {p: statistics.median(v) for p, v in phases.items()} for mode, phases in samples.items()}
    ratios = {p: medians["plain"][p] / medians["shared"][p] for p in PHASES}
    total = {mode: sum(m[p] for p in PHASES) for mode, m in medians.items()}
    print(f"{'phase':<9} {'plain s':>9} {'shared s':>9} {'plain/shared':>13}")
    for p in PHASES:
        print(f"{p:<9} {medians['plain'][p]:>9.3f} {medians['shared'][p]:>9.3f} {ratios[p]:>13.2f}")
    print(f"{'total':<9} {total['plain']:>9.3f} {total['shared']:>9.3f} {total['plain'] / total['shared']:>13.2f}")
    report = {
        "recipe": str(args.recipe), "overrides": args.overrides, "device": device_name(str(device)),
        "versions": versions(), "prompts": len(conversations), "samples_per_prompt": params.n,
        "micro_batch_size": recipe.algo.micro_batch_size, "max_new_tokens": params.max_new_tokens,
        "repeats": args.repeats, "max_logp_diff": gap, "median_s": medians, "plain_over_shared": ratios,
        "total_plain_over_shared": total["plain"] / total["shared"], "samples_s": samples,
    }
    write_report(args.out, report)


if __name__ == "__main__":
    main()
