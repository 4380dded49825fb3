"""The vLLM probe on families `mmrl add-model` scaffolds for types the zoo lacks (issue 8).

    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python bench/vllm_scaffolded.py [--limit N] [--types a,b] \
        [--timeout 300] [--out bench/results/vllm_scaffolded.json] [--fresh]

Which types, by rule (nothing picked by hand): every in-scope row of
`support_matrix/coverage.json` whose scaffold is green there, whose model type no zoo
family registers, and whose transformers class (the architecture the scaffold names) vLLM's
model registry serves for generation (a model class of its own, or its Transformers backend);
causal-LM types first, then image-text-to-text, each
alphabetically; `--limit N` keeps the first N of each mapping. The registry half of the rule
is `mmrl.scaffold.vllm_registry.vllm_serves`, the one `mmrl add-model`'s `vllm` depth
column runs by (`mmrl add-model --sweep --depth-only --columns vllm` records that column for
every green type, zoo types included, in support_matrix/coverage.json).

Each type runs in a fresh process (vLLM's engine and its memory go with it) under a time
limit: `mmrl add-model TYPE --out TMP --no-verify` into a temporary directory under /tmp,
then the `vllm` probe (`mmrl.probes.training.check_vllm`: greedy rollout log-probs against
the trainer's, then again after an optimizer step and a weight sync) on the scaffolded
adapter. A row records the status (verified / failed / not run here), the stage where it ended
(scaffold, load, engine-start, generate, parity, sync, probe, timeout, crash) and one line of
reason. The JSON is rewritten after every type, and a rerun skips the types already
recorded unless `--fresh`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from scaffolded import run_child, say_stage, scaffolded  # bench/scaffolded.py (bench/ is on the path of a bench script)

from mmrl.platform_info import host, versions, write_report

REPO = Path(__file__).resolve().parents[1]
COVERAGE = REPO / "support_matrix" / "coverage.json"
MAPPINGS = ("causal_lm", "image_text_to_text")


def candidates() -> list[dict]:
    """The rule above, applied: [{"model_type", "mapping", "architecture", "vllm_class"}]."""
    from transformers.models.auto import modeling_auto

    from mmrl.registry import families
    from mmrl.scaffold.vllm_registry import vllm_model_class, vllm_serves

    zoo = {t for adapter in families() for t in adapter.model_types}
    tables = {"causal_lm": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
              "image_text_to_text": modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES}
    rows = json.loads(COVERAGE.read_text())["types"]
    picked = []
    for mapping in MAPPINGS:
        for row in sorted(rows, key=lambda r: r["model_type"]):
            if row["mapping"] != mapping or not row["in_scope"] or row["status"] != "green":
                continue
            if row["model_type"] in zoo:
                continue
            architecture = tables[mapping].get(row["model_type"])
            served, _ = vllm_serves(architecture)
            if not served:  # absent, or outside vLLM's generation tables
                continue
            vllm_class = vllm_model_class(architecture)[0] or "transformers (vLLM's Transformers backend)"
            picked.append({"model_type": row["model_type"], "mapping": mapping, "architecture": architecture,
                           "vllm_class": vllm_class})
    return picked


def stage_of(reason: str) -> str:
    """Where a failed or skipped probe ended, read off the one-line reason `check_vllm` gives."""
    stages = {"engine-start": ("vLLM did not load", "vLLM's model reads", "vLLM cannot run", "head sizes",
                               "mixture-of-experts"),
              "generate": ("vLLM generation failed",), "sync": ("vLLM weight sync failed", "after a weight sync"),
              "parity": ("log-probs differ",)}
    for stage, starts in stages.items():
        if any(text in reason for text in starts):
            return stage
    return "probe"


def child(model_type: str) -> None:
    """In a fresh process: scaffold `model_type` under /tmp, run the vLLM probe, print one JSON row."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with scaffolded(model_type, "mmrl-vllm-scaffold") as (adapter, row):
        if adapter is None:
            return
        from mmrl.probes import Subject, probe

        say_stage("probe")
        result = probe("vllm").run(Subject(adapter=adapter, source=adapter.family))
        row.update(status=result.status.value, reason=result.reason.splitlines()[0][:300] if result.reason else "",
                   probe_seconds=round(result.seconds, 1))
        if result.status.value != "verified":
            row["stage"] = stage_of(result.reason)
            if result.evidence.get("traceback"):
                row["traceback"] = result.evidence["traceback"][-1500:]
        else:
            row["evidence"] = {k: v for k, v in result.evidence.items() if k.startswith("max_")}


def run_one(model_type: str, timeout: float) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    return run_child(__file__, model_type, timeout, env=env, cwd=REPO)


def summary(rows: list[dict]) -> dict:
    out = {}
    for mapping in MAPPINGS:
        mine = [r for r in rows if r["mapping"] == mapping]
        out[mapping] = {"tried": len(mine), "verified": sum(r["status"] == "verified" for r in mine),
                        "failed": sum(r["status"] == "failed" for r in mine),
                        "not_run": sum(r["status"] == "not run here" for r in mine)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--types", help="only these comma-separated types (still filtered by the rule)")
    parser.add_argument("--limit", type=int, default=0, help="the first N types of each mapping (0: all)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per type")
    parser.add_argument("--fresh", action="store_true", help="forget the rows already recorded")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "vllm_scaffolded.json")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    import vllm  # noqa: F401 - where vLLM is missing, fail before the first type runs

    picked = candidates()
    if args.types:
        wanted = set(args.types.split(","))
        picked = [c for c in picked if c["model_type"] in wanted]
    if args.limit:
        picked = [c for m in MAPPINGS for c in [c for c in picked if c["mapping"] == m][:args.limit]]
    done = {}
    if args.out.is_file() and not args.fresh:
        done = {r["model_type"]: r for r in json.loads(args.out.read_text())["types"]}
    rows = list(done.values())
    for candidate in picked:
        if candidate["model_type"] in done:
            continue
        row = {**candidate, **run_one(candidate["model_type"], args.timeout)}
        rows.append(row)
        print(f"{row['model_type']:24} {row['status']:9} {row.get('stage', ''):13} {row['seconds']:6.1f}s "
              f"{row['reason'][:110]}", flush=True)
        order = {m: i for i, m in enumerate(MAPPINGS)}
        rows.sort(key=lambda r: (order[r["mapping"]], r["model_type"]))
        write_report(args.out, {
            **versions(("vllm", "transformers", "torch")), "host": host(),
            "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", "bench/vllm_scaffolded.py", *sys.argv[1:]]),
            "rule": __doc__.split("Which types, by rule (nothing picked by hand): ")[1].split("\n\n")[0].replace("\n", " "),
            "summary": summary(rows), "types": rows,
        })
    print(json.dumps(summary(rows)))


if __name__ == "__main__":
    main()
