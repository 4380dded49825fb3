"""The add-model coverage sweep: how much of transformers `mmrl add-model` handles unedited.

Every model type of transformers' causal-LM and image-text-to-text tables is scaffolded
into a scratch out-of-tree package, each in its own process with a time limit, and the
package's generated tests are then run by pytest in another process. A type is green
when the scaffold was written and its generated tests pass with no hand edit. The
result is `support_matrix/coverage.json` and `support_matrix/coverage.md`.

    mmrl add-model --sweep                        # every type; resumes where it stopped
    mmrl add-model --sweep --types olmo2,llava    # just these (merged into the JSON)
    mmrl add-model --sweep --fresh                # forget earlier rows and start over
    mmrl add-model --sweep --depth-only           # green rows again, without their generated tests
    mmrl add-model --sweep --depth-only --columns vllm   # only the vllm column of green rows lacking it
    python -m mmrl.scaffold.sweep page support_matrix/coverage.json   # the page again from the JSON

Rows are written after each type (atomically), so an interrupted sweep resumes from the
rows already there; rows recorded by another transformers version, or before the
capability columns they lack existed, are run again.

Each row has a column per capability the scaffold decides (`COLUMNS`: the quick checks,
then the video, sequence_parallel, multi_turn and vllm probes): "yes" where the adapter
declares it, "no" with a gap (the cause in one line, what to write by hand), "n/a"
where it does not apply (vllm applies to every type: where vLLM's registry does not
serve the architecture with a model class of its own, it is "no" and its gap says so,
decided without running vLLM); where sequence_parallel is "yes", the row also records the mode that
verified and the adapter declares ("ulysses" or "gathered"), and a row without it is run
again. Most of a green type's time is the depth probes' two torchrun
launches; docs/adding_a_model.md gives the measured times of the full and the depth-only
sweep. `--columns` re-sweeps only some depth columns of green rows (with `--depth-only`):
each type's quick checks run again (the adapter the probe runs on is the one the scaffold
writes), then only those probes, and the row keeps its other columns; a type whose
columns can be decided without a process (vllm where vLLM does not serve it) gets them
at once.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from mmrl import errors
from mmrl.platform_info import host, today
from mmrl.scaffold.base import COLUMNS, DEPTH

# Each process's own time limit (seconds); one that runs past it ends the type with
# status "timeout" and the stage's name. The scaffold's covers its stages' limits
# (mmrl.scaffold.STAGE_SECONDS, the depth probes' 840 s included).
SCAFFOLD_SECONDS = 1560
TESTS_SECONDS = 420

# Why a type is out of scope; the coverage page states these rules and their counts.
OUT_OF_SCOPE_RULES = {
    "seq2seq": "the config is an encoder-decoder (is_encoder_decoder, or encoder and decoder sub-configs)",
    "encoder": "transformers also gives the type a masked-LM head: an encoder run as a decoder",
    "audio": "the type is in one of transformers' audio or speech tables",
}


@dataclass
class Row:
    model_type: str
    mapping: str  # "causal_lm" | "image_text_to_text"
    in_scope: bool
    status: str  # "green" or a failure category
    stage: str
    reason: str
    capabilities: list[str] = field(default_factory=list)
    # Per capability column (COLUMNS): "yes", "no" (a gap says why) or "n/a"; empty for a
    # row recorded before the columns existed, or one that stopped before verifying.
    columns: dict[str, str] = field(default_factory=dict)
    gaps: list[dict[str, str]] = field(default_factory=list)  # {"column", "cause", "write"}
    # Where sequence_parallel is "yes": the mode that verified and the adapter declares,
    # "ulysses" or "gathered" (SequenceParallel(gather_mixers=True)); "" where not
    # recorded (a row from before the mode was recorded) or not declared.
    sequence_parallel_mode: str = ""
    seconds: float = 0.0
    scope_rule: str | None = None
    runner: str = ""  # torch version and host the row was measured with (rows of several runs merge)


def swept_types() -> list[tuple[str, str]]:
    """(model_type, mapping) for every type of the two tables; a type in both is swept
    once, as image-text-to-text (its multimodal class is the one a VLM user scaffolds)."""
    from transformers.models.auto import modeling_auto

    vision = modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    causal = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    rows = [(t, "image_text_to_text") for t in vision]
    rows += [(t, "causal_lm") for t in causal if t not in vision]
    return sorted(rows)


def scope_rule(model_type: str) -> str | None:
    """The name of the out-of-scope rule `model_type` falls under, or None (in scope)."""
    import transformers
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    tables = {name: getattr(modeling_auto, name) for name in dir(modeling_auto) if name.endswith("_MAPPING_NAMES")}
    if any(model_type in table for name, table in tables.items()
           if any(word in name for word in ("AUDIO", "SPEECH", "CTC", "SPECTROGRAM", "WAVEFORM"))):
        return "audio"
    config_cls = getattr(transformers, CONFIG_MAPPING_NAMES.get(model_type, ""), None)
    sub_configs = getattr(config_cls, "sub_configs", {}) or {}
    if {"encoder", "decoder"} <= set(sub_configs) or model_type in tables["MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"]:
        return "seq2seq"
    try:
        if config_cls is not None and getattr(config_cls(), "is_encoder_decoder", False):
            return "seq2seq"
    except Exception:  # a config without defaults is judged by its sub-configs alone
        pass
    if model_type in tables["MODEL_FOR_MASKED_LM_MAPPING_NAMES"]:
        return "encoder"
    return None


# -- one type, in a process of its own -------------------------------------------------
def scaffold_worker(model_type: str, out: str, report: str, columns: str = "") -> None:
    """Scaffold `model_type` into `out` and write what happened to `report` (JSON);
    `columns` (comma-separated): only those depth probes. Runs in its own process
    (`python -m mmrl.scaffold.sweep worker ...`)."""
    from mmrl.scaffold import ScaffoldError, scaffold

    record: dict = {"stage": "resolve"}

    def on_stage(name: str) -> None:
        record["stage"] = name
        Path(report).write_text(json.dumps(record))

    try:
        result = scaffold(model_type, family=family_for(model_type), out=out, on_stage=on_stage,
                          replace_registered=True, depth_columns=tuple(columns.split(",")) if columns else None)
    except ScaffoldError as exc:
        record.update(status=exc.category, reason=one_line(str(exc)))
    except Exception as exc:  # a crash inside the scaffold is a bug of its own category
        import traceback

        where = traceback.extract_tb(exc.__traceback__)[-1]
        record.update(status="scaffold-crash",
                      reason=one_line(f"{type(exc).__name__}: {exc} ({Path(where.filename).name}:{where.lineno})"))
    else:
        caps = result.capabilities
        if caps is None:
            record["stage"] = "verify"
        record.update(status="written" if caps is not None else "tiny-model-fails",
                      reason=one_line("; ".join(result.notes)) if caps is None else "",
                      capabilities=[] if caps is None else caps.declared(),
                      columns=columns_of(result), gaps=[asdict(gap) for gap in result.gaps],
                      sequence_parallel_mode=result.sequence_parallel_mode)
    Path(report).write_text(json.dumps(record))


def columns_of(result) -> dict[str, str]:
    """Each capability column of a scaffold result: "yes" (declared), "no" (decided and
    not declared) or "n/a" (not decided: it does not apply to the type)."""
    if result.capabilities is None:
        return {}
    return {column: ("yes" if getattr(result.capabilities, column) else "no") if column in result.decided else "n/a"
            for column in COLUMNS}


def holders(model_type: str) -> list[str]:
    """The registered families that declare `model_type` (hidden while its scaffold is tested)."""
    from mmrl.registry import families

    return [a.family for a in families() if model_type in a.model_types]


def family_for(model_type: str) -> str:
    return "sweep_" + "".join(c if c.isalnum() else "_" for c in model_type.lower())


def one_line(text: str, limit: int = 300) -> str:
    return errors.one_line(str(text), limit, whole=True)


def _run(command: list[str], seconds: float, env: dict) -> tuple[int | None, str]:
    """(return code or None on timeout, combined output)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=seconds, env=env)
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, output if isinstance(output, str) else output.decode(errors="replace")
    return done.returncode, done.stdout + done.stderr


def sweep_one(model_type: str, mapping: str, scaffold_seconds: float = SCAFFOLD_SECONDS,
              tests_seconds: float = TESTS_SECONDS, depth_only: bool = False,
              columns: tuple[str, ...] | None = None) -> Row:
    """Scaffold `model_type` and run its generated tests, each in a process of its own.
    `depth_only` (a type recorded green): the scaffold runs all its stages (the quick
    checks and the depth probes, so every column is decided by this code), and the
    generated tests are not run again: they check what the quick stage decides (save/
    reload, parts, padded, packed, LoRA), not the depth columns, so the recorded green
    stands (stage "depth-only"); a type the scaffold now stops on loses its green.
    `columns`: of the depth probes, only these (the row's other depth columns are n/a:
    `run_sweep` merges the ones asked for into the recorded row)."""
    start = time.monotonic()
    rule = scope_rule(model_type)
    row = Row(model_type, mapping, rule is None, "green", "", "", scope_rule=rule)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory(prefix="mmrl-sweep-") as scratch:
        out, report = Path(scratch) / "pkg", Path(scratch) / "report.json"
        code, output = _run([sys.executable, "-m", "mmrl.scaffold.sweep", "worker", model_type, str(out),
                             str(report), *([",".join(columns)] if columns else [])], scaffold_seconds, env)
        record = json.loads(report.read_text()) if report.is_file() else {}
        row.stage = record.get("stage", "start")
        if code is None:
            row.status, row.reason = "timeout", f"stage {row.stage} ran past the {scaffold_seconds:.0f} s limit"
        elif "status" not in record:
            row.status, row.reason = "scaffold-crash", (_killed(code, f"stage {row.stage}") if code < 0 else one_line(
                output.strip().splitlines()[-1] if output.strip() else f"exit code {code}"))
        elif record["status"] != "written":
            row.status, row.reason = record["status"], record.get("reason", "")
        else:
            row.capabilities = record.get("capabilities", [])
            row.columns, row.gaps = record.get("columns", {}), record.get("gaps", [])
            row.sequence_parallel_mode = record.get("sequence_parallel_mode", "")
            row.stage = "depth-only" if depth_only else "tests"
            if not depth_only:
                _run_tests(row, out, model_type, tests_seconds, env)
    row.seconds = round(time.monotonic() - start, 1)
    row.runner = runner()
    return row


def _run_tests(row: Row, out: Path, model_type: str, seconds: float, env: dict) -> None:
    """Run the generated tests of the package in `out`; a failure sets `row`'s status."""
    tests = out / "tests" / f"test_family_{family_for(model_type)}.py"
    code, output = _run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(tests)],
                        seconds, {**env, "MMRL_HIDE_FAMILIES": ",".join(holders(model_type))})
    if code is None:
        row.status, row.reason = "timeout", f"the generated tests ran past the {seconds:.0f} s limit"
    elif code < 0:
        row.status, row.reason = "tests-fail", _killed(code, "the generated tests")
    elif code != 0:
        row.status, row.reason = "tests-fail", _tests_reason(output)


def _killed(code: int, what: str) -> str:
    """One line for a process the system killed (a negative return code)."""
    import signal

    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if name == "SIGKILL":  # most often the kernel's out-of-memory killer
        return (f"{what}: killed by SIGKILL, most often the system out of memory (the tiny model or its inputs are "
                "too large); write tiny() by hand with smaller shapes")
    return f"{what}: killed by {name}"


def runner() -> str:
    """The torch version and machine a row was measured with: `torch 2.11.0, x86_64, 16 CPUs`."""
    import torch

    return f"torch {torch.__version__}, {host()}"


# What the user writes by hand when a generated test fails, by the test's name.
_TO_WRITE = (
    ("padded", "write the adapter's position_ids or padding so a padded batch equals each prompt alone "
               "(left_padding = False where the forward ignores the mask for pads in front)"),
    ("packed", "write packed positions or declare padding_free=False"),
    ("parts", "name the listed parameters' part in the adapter's parts"),
    ("lora", "set the adapter's LoraTargets"),
    ("save_reload", "fix tiny() or the processing so that the tiny model saves, reloads, trains and generates"),
)


def _tests_reason(output: str) -> str:
    """One line for failed generated tests: the first failing test, its error and what
    to write by hand."""
    reason = _first_failure(output)
    test = re.search(r"^FAILED \S+::(\S+)", output, re.MULTILINE)
    if test is None:
        return one_line(reason)
    advice = next((advice for key, advice in _TO_WRITE if key in test.group(1)),
                  "fix tiny() or the adapter until the family's tests pass")
    return one_line(f"{test.group(1)}: {reason}; {advice}")


def _first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith("E   "):
            return line[4:]
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else "pytest failed"


# -- the whole sweep ---------------------------------------------------------------------
def load_rows(path: Path, version: str) -> dict[str, Row]:
    if not path.is_file():
        return {}
    document = json.loads(path.read_text())
    if document.get("transformers") != version:
        return {}
    return {r["model_type"]: Row(**r) for r in document.get("types", [])}


def write_document(path: Path, rows: dict[str, Row], version: str) -> dict:
    import torch

    document = {
        "transformers": version,
        "torch": torch.__version__,
        "host": host(),
        "date": today(),
        "command": "mmrl add-model --sweep",
        "summary": summarize(rows.values()),
        "types": [asdict(rows[t]) for t in sorted(rows)],
    }
    temp = path.with_suffix(".json.tmp")
    temp.write_text(json.dumps(document, indent=1) + "\n")
    temp.replace(path)
    render_page(document, path.with_suffix(".md"))
    return document


def summarize(rows) -> dict:
    rows = list(rows)
    summary = {}
    for mapping in ("causal_lm", "image_text_to_text"):
        mine = [r for r in rows if r.mapping == mapping]
        scope = [r for r in mine if r.in_scope]
        green = sum(r.status == "green" for r in scope)
        summary[mapping] = {
            "types": len(mine), "in_scope": len(scope), "green": green,
            "green_share": round(green / len(scope), 3) if scope else None,
            "out_of_scope": dict(Counter(r.scope_rule for r in mine if not r.in_scope)),
            "failures": dict(Counter(r.status for r in scope if r.status != "green").most_common()),
        }
        if mapping == "image_text_to_text":
            # Green types whose adapter declares image inputs: a VLM type whose vision
            # tower cannot be found apart from its decoder is scaffolded as a text family.
            summary[mapping]["green_with_images"] = sum(r.status == "green" and "single_image" in r.capabilities
                                                        for r in scope)
        # Depth: how many green types declare each capability column, and how many green
        # rows were recorded with the columns (the rest predate them: re-run to fill in).
        greens = [r for r in scope if r.status == "green"]
        summary[mapping]["declared"] = {column: sum(column in r.capabilities for r in greens) for column in COLUMNS}
        summary[mapping]["green_with_columns"] = sum(has_columns(r) for r in greens)
        # The mode each green type declaring sequence_parallel verified in ("" where the
        # row predates the record: the page counts it as not recorded).
        summary[mapping]["sequence_parallel_modes"] = dict(Counter(
            r.sequence_parallel_mode or "not recorded" for r in greens if r.columns.get("sequence_parallel") == "yes"))
    return summary


def has_columns(row: Row) -> bool:
    """Whether a type the scaffold wrote has every capability column (rows from before
    the columns existed lack some)."""
    written = row.in_scope and row.status in ("green", "tests-fail")
    return not written or set(row.columns) == set(COLUMNS)


def is_current(row: Row) -> bool:
    """Whether a row holds what this sweep records: every capability column, and where it
    declares sequence_parallel, the mode that verified; rows from before either was
    recorded are run again."""
    return has_columns(row) and (row.columns.get("sequence_parallel") != "yes" or bool(row.sequence_parallel_mode))


# Short headers of the capability columns on the page, and the marks of their cells.
COLUMN_HEADERS = {"generation": "gen", "padding_free": "packed", "gradient_checkpointing": "ckpt",
                  "lora_language": "LoRA", "lora_vision": "LoRA-v", "single_image": "image", "multi_image": "images",
                  "media_sharing": "shared", "video": "video", "sequence_parallel": "SP", "multi_turn": "turns",
                  "vllm": "vLLM"}
MARKS = {"yes": "✓", "no": "✗", "n/a": "–"}
# The sequence_parallel cell's mode, after its mark.
SP_MODES = ("ulysses", "gathered")


def render_page(document: dict, path: Path) -> None:
    lines = [
        "# add-model coverage",
        "",
        f"GENERATED by `{document['command']}` on {document['date']} with transformers "
        f"{document['transformers']} (the last run: torch {document.get('torch', '?')}, {document.get('host', '?')}; "
        "each row of coverage.json records the torch and host it ran with); do not edit by hand. A type is **green** when `mmrl add-model TYPE` "
        "wrote the family and the tests it generated pass with no hand edit. Every other type ends "
        "with the stage that stopped it and one line saying why.",
        "",
        "| table | types | in scope | green | share | green with image inputs |",
        "|---|---|---|---|---|---|",
    ]
    for mapping, s in document["summary"].items():
        share = "" if s["green_share"] is None else f"{100 * s['green_share']:.0f}%"
        images = s.get("green_with_images", "-")
        lines.append(f"| {mapping} | {s['types']} | {s['in_scope']} | {s['green']} | {share} | {images} |")
    lines += ["", "Out of scope, by rule:", ""]
    for rule, text in OUT_OF_SCOPE_RULES.items():
        count = sum(s["out_of_scope"].get(rule, 0) for s in document["summary"].values())
        lines.append(f"- **{rule}** ({count} types): {text}.")
    lines += ["", "Failures among in-scope types, by category:", ""]
    failures = Counter()
    for s in document["summary"].values():
        failures.update(s["failures"])
    lines += [f"- `{status}`: {count}" for status, count in failures.most_common()] or ["- none"]
    lines += _depth_lines(document)
    headers = [COLUMN_HEADERS[c] for c in COLUMNS]
    lines += ["", "## Every type", "",
              f"{MARKS['yes']} declared (verified on the tiny model), {MARKS['no']} not declared (the gap below says "
              f"why), {MARKS['n/a']} does not apply; blank: not recorded (a row from before the column existed, or "
              "a type that stopped before verifying). A declared SP cell names the mode that verified and the "
              "adapter declares, which the trainer runs: `ulysses` (attention heads split over the processes) or "
              "`gathered` (`SequenceParallel(gather_mixers=True)`: each sequence-mixing module runs on the gathered "
              f"sequence); a {MARKS['yes']} without a mode is a row recorded before the mode was (its adapter "
              "declares one of the two; `mmrl add-model --sweep --depth-only` records it).", "",
              f"| model type | table | status | stage | {' | '.join(headers)} | reason | s |",
              "|---|---|---|---|" + "---|" * len(headers) + "---|---|"]
    for row in document["types"]:
        status = row["status"] if row["in_scope"] else f"out of scope ({row['scope_rule']})"
        columns = row.get("columns") or {}
        if row["status"] == "green" and not columns:  # recorded before the columns: what it declared
            columns = {c: "yes" for c in row["capabilities"] if c in COLUMNS}
        cells = [MARKS.get(columns.get(c, ""), "") for c in COLUMNS]
        mode = row.get("sequence_parallel_mode", "")
        if mode and columns.get("sequence_parallel") == "yes":
            cells[COLUMNS.index("sequence_parallel")] += f" {mode}"
        reason = "" if row["status"] == "green" else row["reason"].replace("|", "\\|")
        lines.append(f"| `{row['model_type']}` | {row['mapping']} | {status} | {row['stage']} | {' | '.join(cells)} | "
                     f"{reason} | {row['seconds']:g} |")
    gaps = [(row["model_type"], gap) for row in document["types"] if row["status"] == "green"
            for gap in row.get("gaps", [])]
    lines += ["", "## Gaps of green types", "",
              "What a green type's adapter leaves undeclared: the column, the cause, and what to write by hand.", ""]
    lines += [f"- `{model_type}` **{gap['column']}**: {gap['cause']}; to claim it, {gap['write']}."
              for model_type, gap in gaps] or ["- none recorded"]
    path.write_text("\n".join(lines) + "\n")


def _depth_lines(document: dict) -> list[str]:
    """The depth table: per capability column, the green types declaring it, per table."""
    mappings = list(document["summary"])
    lines = ["", "## Depth", "",
             "Green types whose adapter declares each capability (the scaffold declares only what verified on the "
             "tiny model; " + ", ".join(f"`{c}`" for c in DEPTH) + " are decided by their probes: a 4-frame clip, "
             "Ulysses over 2 gloo processes, or gathered mixers where Ulysses fails, an image arriving in turn 3, "
             "vLLM's greedy rollout log-probs against the trainer's before and after a weight sync, run only where "
             "vLLM's registry serves the architecture with a model class of its own).", "",
             "| capability | " + " | ".join(mappings) + " |", "|---|" + "---|" * len(mappings)]
    for column in COLUMNS:
        cells = []
        for mapping in mappings:
            s = document["summary"][mapping]
            count = s.get("declared", {}).get(column, 0)
            share = f" ({100 * count / s['green']:.0f}%)" if s["green"] else ""
            cells.append(f"{count} of {s['green']}{share}")
        lines.append(f"| `{column}` | " + " | ".join(cells) + " |")
    recorded = ", ".join(f"{m} {document['summary'][m].get('green_with_columns', 0)} of {document['summary'][m]['green']}"
                         for m in mappings)
    lines += ["", f"Green rows recorded with every column: {recorded}."]
    modes = []
    for mapping in mappings:
        counted = document["summary"][mapping].get("sequence_parallel_modes", {})
        parts = [f"{counted[m]} {m}" for m in (*SP_MODES, "not recorded") if counted.get(m)]
        modes.append(f"{mapping} {', '.join(parts) or 'none'}")
    lines += ["", "The mode `sequence_parallel` verified in and the adapter declares (`ulysses`: attention heads "
              "split; `gathered`: `SequenceParallel(gather_mixers=True)`): " + "; ".join(modes) + "."]
    return lines


def run_sweep(path: Path, types: list[str] | None = None, fresh: bool = False, progress: bool = True,
              scaffold_seconds: float = SCAFFOLD_SECONDS, tests_seconds: float = TESTS_SECONDS,
              workers: int = 1, depth_only: bool = False, columns: tuple[str, ...] | None = None) -> dict:
    """Run the sweep over `types` (default: every type not yet recorded) into `path`,
    `workers` types at a time (each in processes of its own). `depth_only` re-sweeps
    types recorded green without re-running their generated tests (`sweep_one`); by
    default it takes the green rows that lack a column, image-text-to-text first. One
    that runs out of time keeps its recorded row (on a loaded host, a time limit is no
    verdict); one the scaffold now stops on otherwise loses its green. `columns` (with
    `depth_only`): only these depth columns, merged into the recorded green rows; by
    default the green rows lacking one of them."""
    import threading
    from concurrent.futures import ThreadPoolExecutor, as_completed

    import transformers
    from rich.progress import Progress

    version = transformers.__version__
    if columns is not None:
        unknown = sorted(set(columns) - set(DEPTH))
        if unknown:
            raise ValueError(f"--columns: not a depth column: {', '.join(unknown)} (the depth columns: "
                             f"{', '.join(DEPTH)})")
        if not depth_only:
            raise ValueError("--columns re-sweeps some depth columns of rows recorded green: give --depth-only too")
    rows = {} if fresh else load_rows(path, version)
    table = dict(swept_types())
    if types:
        unknown = [t for t in types if t not in table]
        if unknown:
            raise ValueError(f"not in transformers' causal-LM or image-text-to-text tables: {', '.join(unknown)}")
        todo = list(types)
    elif depth_only:
        lacking = (lambda r: not set(columns) <= set(r.columns)) if columns else (lambda r: not is_current(r))
        todo = sorted((t for t in table if t in rows and rows[t].status == "green" and lacking(rows[t])),
                      key=lambda t: (table[t] != "image_text_to_text", t))
    else:
        todo = [t for t in table if t not in rows or not is_current(rows[t])]
    recorded_green = {t for t in todo if t in rows and rows[t].in_scope and rows[t].status == "green"}
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def one(model_type: str) -> Row:
        rule = scope_rule(model_type)
        if rule is not None:
            return Row(model_type, table[model_type], False, "out-of-scope", "resolve", OUT_OF_SCOPE_RULES[rule],
                       scope_rule=rule)
        again = depth_only and model_type in recorded_green
        if again and columns:
            decided = decided_without_process(model_type, columns)
            if decided is not None:
                return merge_columns(rows[model_type], decided, columns)
        row = sweep_one(model_type, table[model_type], scaffold_seconds, tests_seconds, depth_only=again,
                        columns=columns if again else None)
        if again and row.status == "timeout":  # a loaded host, not a verdict: the green recorded stands
            return rows[model_type]
        if again and columns and row.status == "green":
            return merge_columns(rows[model_type], row, columns)
        return row

    with Progress(disable=not progress, transient=False) as bar, ThreadPoolExecutor(max(1, workers)) as pool:
        task = bar.add_task("add-model sweep", total=len(todo))
        futures = {pool.submit(one, t): t for t in todo}
        for future in as_completed(futures):  # each row is written as soon as it is known
            model_type, row = futures[future], future.result()
            with lock:
                rows[model_type] = row
                write_document(path, rows, version)
            bar.update(task, advance=1, description=f"add-model sweep: {model_type} {row.status}")
    return write_document(path, rows, version)


def decided_without_process(model_type: str, columns: tuple[str, ...]) -> Row | None:
    """A row holding `columns` where each is decided without scaffolding the type (only
    vllm can be: "no" where vLLM does not serve the architecture, the gap saying so, as
    the depth stage decides it); None where a process has to run."""
    from mmrl.scaffold.depth import to_write, vllm_unserved
    from mmrl.scaffold.resolve import resolve

    if set(columns) != {"vllm"}:
        return None
    cause = vllm_unserved(resolve(model_type).model_class)
    if cause is None:
        return None
    cause = one_line(cause, 240)
    return Row(model_type, "", True, "green", "", "", columns={"vllm": "no"},
               gaps=[{"column": "vllm", "cause": cause, "write": to_write("vllm", cause)}])


def merge_columns(recorded: Row, new: Row, columns: tuple[str, ...]) -> Row:
    """`recorded` with `columns` (their cells, declarations and gaps) taken from `new`."""
    from mmrl.adapter import Capabilities

    declared = (set(recorded.capabilities) - set(columns)) | (set(new.capabilities) & set(columns))
    order = [f for f in Capabilities.__dataclass_fields__ if f in declared]
    return replace(recorded, capabilities=order,
                   columns={**recorded.columns, **{c: new.columns.get(c, "n/a") for c in columns}},
                   gaps=[g for g in recorded.gaps if g["column"] not in columns]
                   + [g for g in new.gaps if g["column"] in columns])


def rewrite_page(path: Path) -> None:
    """Write the summary and coverage.md again from the rows of coverage.json at `path`
    (after a sweep was stopped mid-type, or the page's layout changed); runs nothing. Each
    depth gap's advice is derived again from its recorded cause (`depth.to_write`, with
    the type's default config standing in for the tiny one; padding_free's too, whose
    boundary failure has advice of its own), so rows recorded before an advice was
    refined read as new ones do."""
    from mmrl.scaffold.depth import to_write

    document = json.loads(path.read_text())
    rows = {r["model_type"]: Row(**r) for r in document.get("types", [])}
    for row in rows.values():
        for gap in row.gaps:
            if gap["column"] in (*DEPTH, "padding_free"):
                gap["write"] = to_write(gap["column"], gap["cause"], _default_config(row.model_type))
    document.update(summary=summarize(rows.values()), types=[asdict(rows[t]) for t in sorted(rows)])
    temp = path.with_suffix(".json.tmp")
    temp.write_text(json.dumps(document, indent=1) + "\n")
    temp.replace(path)
    render_page(document, path.with_suffix(".md"))


def _default_config(model_type: str):
    """The type's config with its defaults, or None where it takes no defaults."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]()
    except Exception:  # a config without defaults: the advice falls back to the column's
        return None


USAGE = ("usage: python -m mmrl.scaffold.sweep worker MODEL_TYPE OUT REPORT [COLUMNS], or "
         "python -m mmrl.scaffold.sweep page COVERAGE_JSON (the page again from the rows; the sweep itself runs "
         "through `mmrl add-model --sweep`)")

if __name__ == "__main__":
    if len(sys.argv) in (5, 6) and sys.argv[1] == "worker":
        scaffold_worker(*sys.argv[2:])
    elif len(sys.argv) == 3 and sys.argv[1] == "page":
        if not Path(sys.argv[2]).is_file():
            raise SystemExit(f"error: {sys.argv[2]}: no such coverage JSON")
        rewrite_page(Path(sys.argv[2]))
    else:
        raise SystemExit(USAGE)
