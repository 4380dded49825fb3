"""Where the bf16 gap between a rollout backend's log-probs and the trainer's comes from,
per family: the rollout_agreement probe's measurement (`mmrl.probes.rollout_agreement`),
split so that one run points at the part that differs.

For each family (tiny random-init model) and backend (hf, hf_compiled), on the family's
sample prompts and on the same prompts with their images taken out (text only):
- max / mean |Δ log p| and the k3 KL over the sampled tokens, as the probe reports them;
- the largest difference at the first response token (computed from the prompt's
  prefill, where the images act) and at the later tokens (the decode steps);
and the same with the engine's compiled decoder layers off where they were on.

On a GPU the engine computes in bf16 autocast, as the probe does. On a CPU the probe runs
in fp32; `--cpu-autocast` puts both sides under CPU bf16 autocast instead (the closest
the CPU gets to the GPU's figures; the hf_compiled decode loop runs eagerly there, as in
the probe).

    python bench/rollout_agreement_bf16.py --device cuda --out $OUT/rollout_agreement_bf16_gpu.json
    python bench/rollout_agreement_bf16.py --device cpu --cpu-autocast \
        --out bench/results/rollout_agreement_bf16_cpu.json

Results: bench/results/rollout_agreement_bf16_cpu.json (CPU autocast); the probe's
docstring says how its bf16 bound follows from them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("qwen2", "qwen2_5_vl", "gemma3", "smolvlm", "idefics3")


def text_only(conversations: list[list[dict]]) -> list[list[dict]]:
    """The conversations without their image and video parts."""
    def strip(message):
        content = message.get("content")
        if isinstance(content, list):
            content = [p for p in content if p.get("type") not in ("image", "video")] or [{"type": "text", "text": "?"}]
        return {**message, "content": content}

    return [[strip(m) for m in c] for c in conversations]


def breakdown(engine, processing, rollout, conversations) -> dict[str, float]:
    """The probe's figures plus the first-token / later-token split."""
    from mmrl.probes.rollout_agreement import sampled_gaps

    delta, mask = sampled_gaps(engine, processing, rollout, conversations)
    kl = (delta[mask].exp() - 1 - delta[mask]).mean().item()
    later = mask.clone()
    later[:, 0] = False
    return {"max": delta[mask].abs().max().item(), "mean": delta[mask].abs().mean().item(), "kl": max(kl, 0.0),
            "first_token_max": delta[:, 0][mask[:, 0]].abs().max().item(),
            "later_tokens_max": delta[later].abs().max().item() if later.any() else 0.0,
            "tokens": int(mask.sum())}


def measure(family: str, device: str, cpu_autocast: bool, compile_layers: bool | str) -> dict:
    from mmrl.checks import sample_conversations
    from mmrl.config import OptimConfig
    from mmrl.engine import Engine
    from mmrl.probes import Subject
    from mmrl.probes.launcher import single_process
    from mmrl.probes.rollout_agreement import engine_precision
    from mmrl.registry import get_adapter
    from mmrl.rollout import make_rollout

    built = Subject(adapter=get_adapter(family), source=family, device=device).build()
    engine = Engine(built, single_process(device), optim=OptimConfig(lr=1e-2), total_steps=1,
                    compile_layers=compile_layers)
    if cpu_autocast:
        engine.autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    conversations = sample_conversations(built.adapter)
    prompts = {"sample": conversations}
    if built.adapter.is_multimodal:
        prompts["text_only"] = text_only(conversations)
    out = {"precision": "bf16" if cpu_autocast else engine_precision(engine),
           "compiled_layers": engine.compiled_layers is not None}
    for backend in ("hf", "hf_compiled"):
        options = {"compile": False} if backend == "hf_compiled" and device != "cuda" else {}
        rollout = make_rollout(backend, engine, built.processing, **options)
        for name, batch in prompts.items():
            out[f"{backend}/{name}"] = breakdown(engine, built.processing, rollout, batch)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cpu-autocast", action="store_true", help="bf16 autocast on the CPU (both sides)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "rollout_agreement_bf16.json")
    args = parser.parse_args()
    from mmrl.platform_info import device_name, versions, write_report

    report = {"device": device_name(args.device), "versions": versions(), "cpu_autocast": args.cpu_autocast,
              "families": {}}
    print(f"{'family':12s} {'engine':9s} {'backend/prompts':24s} {'max':>9s} {'first':>9s} {'later':>9s} {'KL':>9s}")
    for family in args.families:
        variants = {"auto": "auto"} if args.device != "cuda" else {"auto": "auto", "eager": False}
        for label, compile_layers in variants.items():
            figures = measure(family, args.device, args.cpu_autocast, compile_layers)
            report["families"].setdefault(family, {})[f"compile_layers={label}"] = figures
            for key, f in figures.items():
                if isinstance(f, dict):
                    print(f"{family:12s} {label:9s} {key:24s} {f['max']:9.2e} {f['first_token_max']:9.2e} "
                          f"{f['later_tokens_max']:9.2e} {f['kl']:9.1e}", flush=True)
    write_report(args.out, report, lead="\n")


if __name__ == "__main__":
    main()
