"""Hybrid-attention families packed on a device, each scaffolded type in a process of its own.

Issue 31's packing of stateful layers was verified on CPU only; this runs, per type, the
padding-free probe, the same comparisons under bf16, and packed against padded
forward+backward time on `--device`.

    python bench/hybrid_pack_gpu.py --parallel 4 --time-budget 130 --timeout 60 --out $OUT/hybrid_pack_gpu.json
    .venv/bin/python bench/hybrid_pack_gpu.py --device cpu --types lfm2 --lengths 96,48,24 --repeats 1

Which types, by rule (nothing picked by hand): every in-scope green row of
`support_matrix/coverage.json` that declares padding_free, whose tiny config (the one
`mmrl add-model` writes: its config stage, `mmrl.scaffold.tiny_inputs.tiny_model_inputs`)
lists layer kinds that `mmrl.engine.stateful_layers` runs per sequence
(`mmrl.boundaries.stateful_layer_kinds`: conv, linear_attention, hybrid, ...), alphabetically;
`--types` keeps only those named, `--limit N` the first N. A type the installed transformers
lacks, or whose tiny config does not build here, is skipped with the reason.

Each type runs in a fresh process under `--timeout` (bench/scaffolded.py: a crash or a hang
is that type's row): `mmrl add-model TYPE --out TMP --no-verify` into a temporary directory,
then on `--device`:
- the padding-free probe (`mmrl.probes.model.check_padding_free`) in fp32 decides
  verified/failed with its own tolerances; where it fails on a GPU that allows TF32
  convolutions it runs again without TF32 (`status_without_tf32`);
- `fp32` and `bf16` (the same under bf16 autocast, a figure, not a pass/fail): the boundary
  case (`packed_boundary_gap`: a short sample behind a long neighbour against itself alone,
  log-prob and last hidden state) and max |logit| packed against padded (`packed_vs_padded`);
- `timing`: forward+backward of the same text rows (`--lengths`, characters ~ tokens of the
  tiny character tokenizers) under bf16 autocast, padded (the family's unpadded layout: left
  padding, or one sequence a row) against packed into one row with `seq_idx`, medians of
  `--repeats` alternating runs (bench/timing.py); `stateful_positions` is the S x L batch
  the per-sequence mixers see for a row of T. The plain model forward (its default
  attention), not the engine's varlen kernel: the figure says what the per-sequence layers
  cost, not what a whole training step gains.
The report is rewritten after every type; `--time-budget` (from the start, selection
included) stops starting new types, so a run ends at most one `--timeout` after it.

Measured on the CPU machine (2 cores, shared, load 3-6), transformers 5.19: the rule picks
18 of the 141 declared rows (lfm2, lfm2_moe and lfm2_vl only through the tiny config: their
default configs are all attention); selecting (the tiny configs of all 141 rows) took 43 s
in one process, 8-12 s of it for each of a few VLM types, and 53 s with `--jobs 2` under load. With `--lengths 64,32 --repeats 1` all 18 took
15.4 min: 17 verified, 16-73 s each (zamba 126 s), and kimi_linear ran past 180 s (alone: 181 s,
its torch path ~5 s a forward+backward of 134 tokens here). One type's whole run
(`--types lfm2 --lengths 96,48,24 --repeats 1`, selection included) takes 24-26 s, nearly all
of it interpreter starts and imports (the child's, the `mmrl add-model` CLI's): in one warm
process, scaffolding and measuring a type takes 0.3-3 s. So on the H200 host (16 cores; not
measured there yet) the device call should run types side by side and bound the run below
its ~200 s: `--parallel 4 --time-budget 130 --timeout 60` (types left out are listed under
`not_started`; a type still running at the budget ends by its timeout), or `--types` for a
chosen few. Side by side, the timings are noisier; `--parallel 1` for the time figures alone.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, ThreadPoolExecutor, wait
from multiprocessing import get_context
from pathlib import Path

from scaffolded import run_child, say_stage, scaffolded  # bench/scaffolded.py (bench/ is on the path of a bench script)

from mmrl.platform_info import device_name, host, today, versions, write_report

REPO = Path(__file__).resolve().parents[1]
COVERAGE = REPO / "support_matrix" / "coverage.json"
LENGTHS = (512, 448, 384, 320, 256, 192, 128, 64)
FILLER = "The river bends past the old mill, where the water runs slow and green. "


# -- which types ------------------------------------------------------------------------
def declared_types(coverage: dict) -> list[str]:
    """The rows the rule starts from: in scope, green, padding_free among the capabilities."""
    return sorted(row["model_type"] for row in coverage["types"]
                  if row["in_scope"] and row["status"] == "green" and "padding_free" in row["capabilities"])


def tiny_layer_kinds(model_type: str) -> dict:
    """{"model_type", "kinds"}: the stateful layer kinds of the type's tiny config, as the
    scaffold builds it; or {"model_type", "reason"} where that cannot be told here. Told once
    a process (building a tiny config runs its model): a second selection reads the first's."""
    return dict(_told(model_type))


@functools.cache
def _told(model_type: str) -> dict:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from mmrl.boundaries import stateful_layer_kinds
    from mmrl.errors import whole_cause
    from mmrl.scaffold import quiet_transformers
    from mmrl.scaffold.resolve import resolve
    from mmrl.scaffold.tiny_inputs import tiny_model_inputs

    if model_type not in CONFIG_MAPPING_NAMES:
        return {"model_type": model_type, "reason": f"transformers {transformers.__version__} has no model type "
                                                    f"{model_type!r}"}
    try:
        with quiet_transformers():
            config = tiny_model_inputs(resolve(model_type)).config
    except Exception as exc:  # noqa: BLE001 - a type that cannot be told is skipped with the reason
        return {"model_type": model_type, "reason": f"no tiny config with transformers {transformers.__version__}: "
                                                    f"{whole_cause(exc)}"[:300]}
    return {"model_type": model_type, "kinds": sorted(stateful_layer_kinds(config))}


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def select(coverage: dict, types: list[str] | None = None, jobs: int = 1) -> dict:
    """The rule applied: {"declared", "picked": [{"model_type", "kinds"}], "attention_only",
    "skipped": [{"model_type", "reason"}]}. `jobs` > 1 builds the tiny configs in forked
    processes (a few VLM types take seconds each)."""
    declared = declared_types(coverage)
    names = declared if types is None else [t for t in declared if t in types]
    skipped = [{"model_type": t, "reason": "not an in-scope green row of coverage.json that declares padding_free"}
               for t in (types or []) if t not in declared]
    if jobs > 1 and len(names) > 1:
        import mmrl.scaffold.tiny_inputs  # noqa: F401 - imported once, before the workers fork

        with ProcessPoolExecutor(jobs, mp_context=get_context("fork"), initializer=_one_thread) as pool:
            told = list(pool.map(tiny_layer_kinds, names))
    else:
        told = [tiny_layer_kinds(t) for t in names]
    return {"declared": len(declared), "picked": [t for t in told if t.get("kinds")],
            "attention_only": sorted(t["model_type"] for t in told if t.get("kinds") == []),
            "skipped": skipped + [t for t in told if "reason" in t]}


# -- one type, in its own process -------------------------------------------------------
def text_conversations(adapter, lengths) -> list[list[dict]]:
    """One user turn of about `n` characters for each n, as the family's processor takes text."""
    texts = [(FILLER * (n // len(FILLER) + 1))[:n] for n in lengths]
    if "image" in adapter.modalities:
        return [[{"role": "user", "content": [{"type": "text", "text": text}]}] for text in texts]
    return [[{"role": "user", "content": text}] for text in texts]


def figures(built, device: str, bf16: bool) -> dict:
    """The probe's two comparisons as figures, in fp32 or under bf16 autocast."""
    import contextlib

    import torch

    from mmrl.checks import packed_boundary_gap, packed_vs_padded, sample_conversations

    precision = torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with torch.device(device), precision:
        boundary = packed_boundary_gap(built)
        gap = packed_vs_padded(built, sample_conversations(built.adapter))
    return {"boundary_logprob": boundary.logprob, "boundary_hidden": boundary.hidden, "packed_vs_padded": gap}


def forward_backward_ms(built, device: str, lengths, repeats: int) -> dict:
    """Median ms of a forward+backward (bf16 autocast) of the same rows, padded and packed."""
    import torch
    from timing import alternate  # bench/timing.py (bench/ is on the path of a bench script)

    from mmrl.checks import model_inputs
    from mmrl.engine import stateful_layers
    from mmrl.engine.packing import pack_sequences

    dev = torch.device(device)
    model = built.model.train()
    stateful_layers.install(model, built.adapter)  # as the engine does where it packs
    with torch.device(device):
        batch = built.inputs(text_conversations(built.adapter, lengths))
        mask = batch["attention_mask"].bool()
        pad = built.tokenizer.pad_token_id or 0
        packed = pack_sequences(batch, mask[:, :0], row_tokens=int(mask.sum()), pad_token_id=pad)
        padded = batch if built.adapter.left_padding else stateful_layers.packed_inputs(
            model, pack_sequences(batch, mask[:, :0], row_tokens=1, pad_token_id=pad))
    layouts = {"padded": model_inputs(padded), "packed": model_inputs(stateful_layers.packed_inputs(model, packed))}

    def step(mode: str) -> float:
        model.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        start = time.perf_counter()
        with torch.device(device), torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = model(**layouts[mode]).logits
        logits.float().logsumexp(-1).mean().backward()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - start

    _, medians, peaks, failed = alternate(["padded", "packed"], step, repeats, dev, free=lambda: None)
    real = mask.sum(-1)
    out = {"sequences": len(lengths), "tokens": int(real.sum()), "longest": int(real.max()),
           "padded_positions": int(layouts["padded"]["input_ids"].numel()),
           "packed_positions": int(layouts["packed"]["input_ids"].numel()),
           "stateful_positions": len(lengths) * int(real.max()),
           **{f"{mode}_ms": round(seconds * 1e3, 2) for mode, seconds in medians.items()}}
    if len(medians) == 2:
        out["packed_over_padded"] = round(medians["packed"] / medians["padded"], 3)
    if peaks:
        out["peak_gib"] = {mode: round(gib, 3) for mode, gib in peaks.items()}
    if failed:
        out["failed"] = failed
    return out


def measure(adapter, device: str, lengths, repeats: int) -> dict:
    """The row's outcome and figures for one loaded adapter (see the module docstring)."""
    import torch

    from mmrl.engine import stateful_layers
    from mmrl.probes import Subject, probe
    from mmrl.probes.launcher import exact_numerics

    subject = Subject(adapter=adapter, source=adapter.family, device=device)
    say_stage("probe")
    result = probe("padding_free").run(subject)
    row = {"status": result.status.value, "reason": result.reason.splitlines()[0][:300] if result.reason else "",
           "probe_seconds": round(result.seconds, 2)}
    if result.status.value == "failed" and device.startswith("cuda") and torch.backends.cudnn.allow_tf32:
        tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        exact_numerics()
        try:
            row["status_without_tf32"] = probe("padding_free").run(subject).status.value
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    built = subject.build()
    row["stateful_mixers"] = len(stateful_layers.install(built.model, adapter))
    for name, task in (("fp32", lambda: figures(built, device, bf16=False)),
                       ("bf16", lambda: figures(built, device, bf16=True)),
                       ("timing", lambda: forward_backward_ms(built, device, lengths, repeats))):
        say_stage(name)
        start = time.perf_counter()
        try:
            row[name] = task()
        except Exception as exc:  # noqa: BLE001 - a figure that cannot be taken says why
            row[name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
        row[f"{name}_seconds"] = round(time.perf_counter() - start, 2)
    return row


def child(model_type: str, device: str, lengths, repeats: int) -> None:
    """In a fresh process: scaffold `model_type` into a temporary directory, measure, print one JSON row."""
    with scaffolded(model_type, "mmrl-hybrid-pack") as (adapter, row):
        if adapter is None:
            return
        try:
            row.update(measure(adapter, device, lengths, repeats))
        except Exception as exc:  # noqa: BLE001 - recorded as the row's outcome
            row.update(status="failed", stage="measure", reason=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])


# -- the run ----------------------------------------------------------------------------
def summary(rows: list[dict], not_started: list[str]) -> dict:
    ratios = [r["timing"]["packed_over_padded"] for r in rows if "packed_over_padded" in r.get("timing", {})]
    return {"tried": len(rows), "verified": sum(r["status"] == "verified" for r in rows),
            "failed": sum(r["status"] == "failed" for r in rows), "not_started": len(not_started),
            "median_packed_over_padded": round(statistics.median(ratios), 3) if ratios else None}


def print_table(rows: list[dict]) -> None:
    def number(value) -> str:
        return f"{value:8.1e}" if isinstance(value, float) else f"{'-':>8}"

    print(f"{'type':20} {'status':9} {'fp32 lp':>8} {'fp32 hid':>8} {'fp32 pad':>8} {'bf16 lp':>8} {'bf16 pad':>8} "
          f"{'pad ms':>7} {'pack ms':>7} {'ratio':>6} {'s':>6}")
    for r in rows:
        fp32, bf16, timing = r.get("fp32", {}), r.get("bf16", {}), r.get("timing", {})
        print(f"{r['model_type']:20} {r['status']:9} {number(fp32.get('boundary_logprob'))} "
              f"{number(fp32.get('boundary_hidden'))} {number(fp32.get('packed_vs_padded'))} "
              f"{number(bf16.get('boundary_logprob'))} {number(bf16.get('packed_vs_padded'))} "
              f"{timing.get('padded_ms', '-'):>7} {timing.get('packed_ms', '-'):>7} "
              f"{timing.get('packed_over_padded', '-'):>6} {r.get('seconds', 0):6.1f}")
        if r["status"] != "verified" and r.get("reason"):
            print(f"{'':20} {r['reason'][:110]}")


def spent(start: float, budget: float) -> bool:
    """Whether `budget` seconds (0: none) have passed since `start` (time.monotonic)."""
    return bool(budget) and time.monotonic() - start >= budget


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--types", help="only these comma-separated types (still filtered by the rule)")
    parser.add_argument("--limit", type=int, default=0, help="the first N picked types (0: all)")
    parser.add_argument("--time-budget", type=float, default=0.0,
                        help="seconds from the start after which no new type starts (0: no budget)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per type")
    parser.add_argument("--parallel", type=int, default=1,
                        help="types run at a time (they share the device: their timings are noisier)")
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                        help="processes that build the tiny configs while selecting")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                        help="characters of each timed row's text (comma-separated)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (after one warm-up)")
    parser.add_argument("--coverage", type=Path, default=COVERAGE, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "hybrid_pack_gpu.json")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.child:
        child(args.child, args.device, lengths, args.repeats)
        return
    start = time.monotonic()
    selection = select(json.loads(args.coverage.read_text()), args.types.split(",") if args.types else None,
                       args.jobs)
    selection["seconds"] = round(time.monotonic() - start, 1)
    picked = selection["picked"][:args.limit] if args.limit else selection["picked"]
    print(f"{len(picked)} of {selection['declared']} declared types have stateful layers in their tiny config "
          f"({selection['seconds']}s); skipped: {', '.join(s['model_type'] for s in selection['skipped']) or 'none'}",
          flush=True)
    numerics = {}
    if args.device.startswith("cuda"):
        import torch

        numerics = {"matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                    "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32}
    rows: list[dict] = []
    child_args = ("--device", args.device, "--lengths", args.lengths, "--repeats", str(args.repeats))
    child_env = dict(os.environ)
    if args.parallel > 1:  # the children share the host's cores
        child_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.parallel)))
    pending = list(picked)
    with ThreadPoolExecutor(args.parallel) as pool:
        running: dict = {}
        while pending or running:
            while pending and len(running) < args.parallel and not spent(start, args.time_budget):
                candidate = pending.pop(0)
                running[pool.submit(run_child, __file__, candidate["model_type"], args.timeout, child_args,
                                    env=child_env, cwd=REPO)] = candidate
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                row = {**running.pop(future), **future.result()}
                rows.append(row)
                print(f"{row['model_type']:20} {row['status']:9} {row['seconds']:6.1f}s "
                      f"{row.get('reason', '')[:100]}", flush=True)
            rows.sort(key=lambda r: r["model_type"])
            report(args, argv, selection, numerics, rows, [c["model_type"] for c in pending])
    if not rows:
        report(args, argv, selection, numerics, rows, [c["model_type"] for c in pending])
    print()
    print_table(rows)
    if pending:
        print(f"not started (--time-budget spent): {', '.join(c['model_type'] for c in pending)}")


def report(args, argv, selection: dict, numerics: dict, rows: list[dict], not_started: list[str]) -> None:
    """The JSON report as it stands (rewritten after every type, so a cut-short call keeps its rows)."""
    command = sys.argv[1:] if argv is None else argv
    write_report(args.out, {
        **versions(("mmrl", "torch", "transformers")), "host": host(), "device": device_name(args.device),
        "date": today(), "command": " ".join(["python", "bench/hybrid_pack_gpu.py", *command]),
        "rule": __doc__.split("Which types, by rule (nothing picked by hand): ")[1].split("\n\n")[0].replace("\n", " "),
        "numerics": numerics, "lengths": args.lengths, "repeats": args.repeats,
        "selection": selection, "summary": summary(rows, not_started), "not_started": not_started, "types": rows,
    })


if __name__ == "__main__":
    main()
