"""Whether two runs learn the same: the first training step of one variant in each of two
bench/recipe_steps.py reports made with `--same-start` (same initial weights, same seed).
Reports made without it compare too, and show how far apart two starts are.

Every metric of the two first steps is listed with both values and their absolute and
relative difference; three groups decide the verdict:

- rewards (`reward/*`): equal within 1e-6. The later run replays the first run's first
  rollout (`--same-start` keeps it), and the same rollouts get the same rewards.
- log-prob-derived metrics (keys with `logprob`, `kl`, `entropy`, `ratio` or `loss`):
  within bf16 tolerance, since two code paths may round bf16 matmuls differently.
- response length: equal.

Timings and the other metrics (grad norm, learning rate, counts) are listed, not judged.
Where both reports have the first rollout's tokens, the share of identical responses is
listed too, also not judged: one bf16 rounding can flip one sampled token, after which
that response takes another path; the rewards show whether that changed anything.
Read that share along with the verdict on a random-init model: its entropy sits near
the uniform one whatever the weights, so the log-prob metrics of two different starts
can pass the bf16 tolerance too (tiny_vlm_count's seeds 0 and 1 do), and noise responses
may all score 0; the tokens tell two starts apart where those cannot.

    python bench/same_learning.py $OUT/old.json $OUT/new.json --out $OUT/same_learning.json
    python bench/same_learning.py a.json b.json --variant-a rows --variant-b packed --out c.json

Exit status 0 whatever the verdict (it is in the JSON and the last line printed); 1 with
a one-line message when a report is missing or holds no first step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mmrl.platform_info import write_report

REWARD_TOLERANCE = 1e-6
# bf16 keeps 8 significant bits (relative rounding 2**-9, about 2e-3); a log-prob summed
# through a few dozen bf16 layers drifts by several roundings, so 2e-2 relative leaves
# room for a different kernel order while a different start (other weights, other
# rollouts) moves these metrics far more. The absolute bound covers metrics near zero
# (the policy loss at ratio 1, a KL of 0), where a relative difference means nothing.
BF16_RELATIVE = 2e-2
BF16_ABSOLUTE = 1e-2
LOGPROB_WORDS = ("logprob", "kl", "entropy", "ratio", "loss")


class ReportError(Exception):
    """A report that cannot be compared (missing, unreadable, no first step)."""


def group_of(key: str) -> str:
    """The verdict group of a metric: reward, logprob, length; timing and other are not judged."""
    if key.startswith("time/") or key.endswith("_per_s"):
        return "timing"  # before the words: `time/logprob` is a time
    if key.startswith("reward/"):
        return "reward"
    if key == "response/length":
        return "length"
    if any(word in key for word in LOGPROB_WORDS):
        return "logprob"
    return "other"


def passes(group: str, a: float, b: float) -> bool | None:
    """Whether two values of a metric agree within its group's tolerance (None: not judged)."""
    difference = abs(a - b)
    if group == "reward":
        return difference <= REWARD_TOLERANCE
    if group == "logprob":
        return difference <= BF16_ABSOLUTE or difference <= BF16_RELATIVE * max(abs(a), abs(b))
    if group == "length":
        return a == b
    return None


def load_variant(path: Path, variant: str | None) -> tuple[str, dict]:
    """(variant name, variant report) from a recipe_steps JSON; the first variant unless named."""
    if not path.is_file():
        raise ReportError(f"{path}: no such file")
    try:
        variants = json.loads(path.read_text())["variants"]
    except (ValueError, KeyError, TypeError):
        raise ReportError(f"{path}: not a bench/recipe_steps.py report (no 'variants')") from None
    if variant is None:
        if not variants:
            raise ReportError(f"{path}: no variant ran (see its 'errors')")
        variant = next(iter(variants))
    elif variant not in variants:
        raise ReportError(f"{path}: no variant {variant!r}; it has {', '.join(variants) or 'none'}")
    report = variants[variant]
    if not report.get("first_step"):
        raise ReportError(f"{path}: variant {variant!r} has no first_step (a report from before --same-start)")
    return variant, report


def compare_rollouts(a: dict | None, b: dict | None) -> dict | None:
    """How much of the two first rollouts is the same token for token (None: not recorded)."""
    if not a or not b or "ids" not in a or "ids" not in b:
        return None
    pairs = list(zip(a["ids"], b["ids"]))
    shared = 0
    for x, y in pairs:
        prefix = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        shared += prefix
    tokens = max(a.get("tokens", 0), b.get("tokens", 0), 1)
    return {"responses": [len(a["ids"]), len(b["ids"])],
            "identical_responses": sum(x == y for x, y in pairs) / max(len(pairs), 1),
            "shared_prefix_tokens": shared / tokens}


def compare(a: dict, b: dict) -> dict:
    """Per-metric values and differences, per-group verdicts, and the overall verdict;
    a judged group with no metric in both runs fails (nothing shows they agree)."""
    first_a, first_b = a["first_step"], b["first_step"]
    metrics = {}
    for key in sorted(set(first_a) & set(first_b)):
        x, y = float(first_a[key]), float(first_b[key])
        group = group_of(key)
        difference = abs(x - y)
        scale = max(abs(x), abs(y))
        metrics[key] = {"group": group, "a": x, "b": y, "abs_diff": difference,
                        "rel_diff": difference / scale if scale else 0.0,
                        "ok": passes(group, x, y)}  # NaN fails every comparison
    groups = {}
    for group in ("reward", "logprob", "length"):
        verdicts = [m["ok"] for m in metrics.values() if m["group"] == group]
        groups[group] = bool(verdicts) and all(verdicts)
    return {"metrics": metrics, "groups": groups, "same_learning": all(groups.values()),
            "only_in_a": sorted(set(first_a) - set(first_b)), "only_in_b": sorted(set(first_b) - set(first_a)),
            "rollout": compare_rollouts(a.get("first_rollout"), b.get("first_rollout"))}


def print_table(result: dict) -> None:
    judged = {k: m for k, m in result["metrics"].items() if m["ok"] is not None}
    width = max([len(k) for k in judged] + [6])
    print(f"{'metric':<{width}}  {'a':>12}  {'b':>12}  {'abs diff':>9}  {'rel diff':>9}  ok")
    for key, m in judged.items():
        print(f"{key:<{width}}  {m['a']:>12.6g}  {m['b']:>12.6g}  {m['abs_diff']:>9.2g}  {m['rel_diff']:>9.2g}  "
              f"{'yes' if m['ok'] else 'NO'}")
    others = len(result["metrics"]) - len(judged)
    print(f"({others} more metrics in the JSON, not judged: timings, grad norm, learning rate, counts)")
    if result["rollout"]:
        r = result["rollout"]
        print(f"first rollout: {r['identical_responses']:.0%} of responses identical, "
              f"{r['shared_prefix_tokens']:.0%} of tokens before the first difference")
    groups = ", ".join(f"{g} {'yes' if ok else 'NO'}" for g, ok in result["groups"].items())
    print(f"{groups}: same learning {'yes' if result['same_learning'] else 'NO'}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="a recipe_steps.py JSON made with --same-start")
    parser.add_argument("b", type=Path, help="another, made with the same --same-start folder")
    parser.add_argument("--variant-a", default=None, help="the variant of A to compare (default: its first)")
    parser.add_argument("--variant-b", default=None, help="the variant of B to compare (default: its first)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        name_a, a = load_variant(args.a, args.variant_a)
        name_b, b = load_variant(args.b, args.variant_b)
    except ReportError as exc:
        sys.exit(f"same_learning.py: {exc}")
    result = {"a": {"file": str(args.a), "variant": name_a, "same_start": a.get("same_start")},
              "b": {"file": str(args.b), "variant": name_b, "same_start": b.get("same_start")},
              **compare(a, b),
              "tolerance": {"reward_abs": REWARD_TOLERANCE, "logprob_rel": BF16_RELATIVE,
                            "logprob_abs": BF16_ABSOLUTE, "length": "equal"}}
    if a.get("same_start") != b.get("same_start"):
        print(f"note: the runs name different starts ({a.get('same_start')} and {b.get('same_start')})")
    print_table(result)
    write_report(args.out, result)
    return result


if __name__ == "__main__":
    main()
