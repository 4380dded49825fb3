"""Issue 10's GPU targets, from the bench results that measured them (bench/results/*.json).

Each target names its measurement, the baseline it was measured against in the same run,
the ratio, the target and whether it is met; targets whose bench has not run yet are
listed with `measured: null`. Writes bench/results/gpu_targets.json and prints a table.

    .venv/bin/python bench/gpu_targets.py
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s, the H200's specification


def model_flops(report: dict, seconds: float) -> float:
    """Model FLOP/s of one packed update counted on real tokens: 6 x non-embedding
    parameters per token, the output projection for response tokens only (all the update
    needs), causal attention per sequence (6 x L^2 x width per layer, forward + backward)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("packing_bench", Path(__file__).with_name("packing.py"))
    packing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(packing)
    shape = packing.SHAPES[report["shape"]]
    width, vocab, layers = shape["hidden_size"], shape["vocab_size"], shape["num_hidden_layers"]
    attention_width = shape["num_attention_heads"] * shape["head_dim"]
    dense = 6 * (report["parameters"] - vocab * width) * report["real_tokens"]
    head = 6 * vocab * width * report["response_tokens"]
    lengths = [p + r for p, r in zip(report["prompt_lengths"], report["response_lengths"])]
    attention = sum(6 * length ** 2 * attention_width * layers for length in lengths)
    return (dense + head + attention) / seconds


def recipe_step_entries() -> list[dict]:
    """Entries from bench/recipe_steps.py results (recipe_steps_*.json): each variant's
    median step against the file's first variant, measured in the same call. Issue 10 sets
    no target for these; they are recorded for the decisions they inform."""
    entries = []
    for path in sorted(RESULTS.glob("recipe_steps_*_gpu.json")):
        report = json.loads(path.read_text())
        variants = report["variants"]
        if not variants:
            continue
        first_name, first = next(iter(variants.items()))
        for name, variant in variants.items():
            split = ", ".join(f"{k} {v:.2f} s" for k, v in variant["median_s"].items() if k != "step")
            compared = name != first_name
            entries.append({
                "name": f"{path.stem}: {name}" + (f" vs {first_name}" if compared else "") + " (median step, s)",
                "measured": variant["median_s"]["step"], "baseline": first["median_s"]["step"] if compared else None,
                "ratio": first["median_s"]["step"] / variant["median_s"]["step"] if compared else None,
                "target": None, "met": None, "command": report["command"],
                "note": f"{report['steps']} steps, median of steps 2-{report['steps']}: {split}; peak "
                        f"{variant.get('peak_allocated_gib', 0):.1f} GiB allocated; {variant['micro_batches']} "
                        f"micro-batches, {variant['optimizer_steps']} optimizer steps; overrides "
                        f"{' '.join(variant['overrides']) or 'none'}",
            })
    return entries


def main() -> None:
    targets = []
    packing_file = RESULTS / "packing_gpu.json"
    packing = json.loads(packing_file.read_text()) if packing_file.is_file() else None
    command = "python bench/packing.py --modes padded packed_4096 varlen_4096 varlen_8192"
    if packing:
        medians = packing["median_step_s"]
        best = min((m for m in medians if m != "padded"), key=medians.get)
        ratio = medians["padded"] / medians[best]
        targets.append({
            "name": "actor update, 0.5B-shaped text, RL lengths: packed real tokens/s vs padded",
            "measured": packing["real_tokens_per_s"][best], "baseline": packing["real_tokens_per_s"]["padded"],
            "ratio": ratio, "target": 2.0, "met": ratio >= 2.0, "mode": best, "command": command,
            "note": "baseline: the engine's padded path (HF forward, SDPA, chunked fp32 log-probs) in the same run",
        })
        utilization = model_flops(packing, medians[best]) / H200_BF16_PEAK
        targets.append({
            "name": "actor update, 0.5B-shaped text: model-FLOPs utilization on real tokens",
            "measured": utilization, "baseline": model_flops(packing, medians["padded"]) / H200_BF16_PEAK,
            "ratio": None, "target": 0.40, "met": utilization >= 0.40, "mode": best, "command": command,
            "note": f"peak {H200_BF16_PEAK / 1e12:.0f} TFLOP/s (bf16 dense); baseline: the padded step's "
                    "utilization counted on the same real tokens",
        })
    targets += recipe_step_entries()
    for name, target in (
        ("VL-3B-shaped recipe: median step vs commit 2446380", 2.0),
        ("HF rollout tokens/s vs plain generate (0.5B, batch 64, prompt 256, 256 new)", 10.0),
        ("end-to-end GRPO step vs TRL 1.16 GRPOTrainer (0.5B, 8x8x256)", 3.0),
        ("log-probs + entropy at 16 x 4096 tokens, 152k vocabulary: extra peak GiB (at most)", 5.0),
    ):
        targets.append({"name": name, "measured": None, "baseline": None, "ratio": None, "target": target,
                        "met": False, "command": None, "note": "not measured yet"})
    summary = {
        "device": packing["device"] if packing else None, "versions": packing["versions"] if packing else None,
        "date": datetime.date.today().isoformat(), "targets": targets,
    }
    (RESULTS / "gpu_targets.json").write_text(json.dumps(summary, indent=2) + "\n")
    for t in targets:
        measured = "-" if t["measured"] is None else f"{t['measured']:.3g}"
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}x"
        verdict = {True: "met ", False: "miss", None: "info"}[t["met"]]
        print(f"{verdict} {measured:>9} {ratio:>7}  target {str(t['target']):<5} {t['name']}")


if __name__ == "__main__":
    main()
