"""The figures and names README.md and docs/ state are the code's: the recipe's parameter
count, the recipe keys of docs/training.md against mmrl/config.py, the synthetic tasks it
lists, the metric names it documents, the commands CI runs, and the tables of
docs/performance.md against the bench/results/ files they quote.

    .venv/bin/python -m pytest -q tests/test_docs.py
"""

import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
TRAINING = (REPO / "docs" / "training.md").read_text()
PERFORMANCE = (REPO / "docs" / "performance.md").read_text()


def _without_parentheses(text: str) -> str:
    """`text` with every parenthesised part (nested ones included) removed."""
    out, depth = [], 0
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(char)
    return "".join(out)


def documented_recipe_keys() -> dict[str, set[str]]:
    """{section: field names} from the recipe table of docs/training.md: a row
    "| `section` | `field` (what it is), `field`, ... |"; backticked words inside
    parentheses are values or examples, not fields."""
    table = TRAINING.split("| section | fields |", 1)[1].split("\n\n", 1)[0]
    sections: dict[str, set[str]] = {}
    for line in table.splitlines():
        match = re.match(r"\|\s*`(\w+)`\s*\|(.*)\|\s*$", line)
        if match:
            fields = _without_parentheses(match.group(2)).split(":", 1)[0]
            sections[match.group(1)] = set(re.findall(r"`(\w+)`", fields))
    return sections


def schema_recipe_keys() -> dict[str, set[str]]:
    from pydantic import BaseModel

    from mmrl.config import Recipe

    keys = {}
    for name, field in Recipe.model_fields.items():
        section = field.annotation
        assert isinstance(section, type) and issubclass(section, BaseModel), f"{name} is not a section"
        keys[name] = set(section.model_fields)
    return keys


def test_training_docs_name_every_recipe_key_and_no_other():
    documented, schema = documented_recipe_keys(), schema_recipe_keys()
    assert set(documented) == set(schema), "sections differ between docs/training.md and mmrl/config.py"
    for section, fields in schema.items():
        assert documented[section] - fields == set(), f"docs/training.md documents keys {section} lacks"
        assert fields - documented[section] == set(), f"docs/training.md does not document these {section} keys"


def test_training_docs_list_every_synthetic_task():
    from mmrl.data.synthetic import TASKS

    block = TRAINING.split("### Synthetic tasks", 1)[1].split("\n#", 1)[0]
    listed = re.findall(r"^\| `(\w+)` \|", block, flags=re.M)
    assert listed == list(TASKS)


def test_training_docs_list_every_builtin_reward():
    """The rewards section's "a built-in: ..." list is mmrl.rewards.BUILTIN_REWARDS, in order."""
    from mmrl.rewards import BUILTIN_REWARDS

    section = TRAINING.split("\n## Rewards", 1)[1].split("\n## ", 1)[0]
    line = re.search(r"^- a built-in: (.*?)\(", section, flags=re.M | re.S).group(1)
    assert re.findall(r"`(\w+)`", line) == list(BUILTIN_REWARDS)


def test_training_docs_name_the_metrics_the_trainer_logs():
    """The validation/ and eval/ names are the trainer's prefixes on mmrl/evaluation.py's names."""
    trainer = (REPO / "mmrl" / "trainer.py").read_text()
    evaluation = (REPO / "mmrl" / "evaluation.py").read_text()
    written = TRAINING.split("## What a run writes", 1)[1]
    names = re.findall(r"`((?:validation|eval)/\w+)`", written)
    assert names
    for name in names:
        prefix, metric = name.split("/", 1)
        assert f'f"{prefix}/{{name}}"' in trainer and f'"{metric}"' in evaluation, \
            f"docs/training.md names {name}, which mmrl/trainer.py does not log"
    assert '"validation/accuracy"' in trainer and "`validation/accuracy`" in written
    table = TRAINING.split("## Evaluation", 1)[1].split("\n## ", 1)[0]
    for metric in re.findall(r"^\| `(\w+)` \|", table, flags=re.M):
        assert f'"{metric}"' in evaluation, f"docs/training.md's Evaluation table names {metric}, which is not logged"


def _anchor(heading: str) -> str:
    """GitHub's id for a Markdown heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_docs_reach_a_file_and_heading():
    """Every `[..](file.md#anchor)` link in README.md and docs/*.md names a file that exists
    and one of its headings (the performance notes moved out of training.md, issue 32)."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    checked = 0
    for page in pages:
        for target, anchor in re.findall(r"\]\(([\w./-]*\.md)?#([\w-]+)\)", page.read_text()):
            linked = (page.parent / target).resolve() if target else page
            assert linked.is_file(), f"{page.name} links to {target}, which does not exist"
            headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)
            assert anchor in {_anchor(h) for h in headings}, f"{page.name} links to {target}#{anchor}: no such heading"
            checked += 1
    assert checked >= 10


def test_readme_names_every_command_ci_runs():
    test_section = README.split("## Test", 1)[1].split("\n## ", 1)[0]
    script = (REPO / ".ci" / "run").read_text()
    commands = [line.strip() for line in script.splitlines()
                if line.strip().startswith((".venv/bin/", "bash "))]
    assert commands, "no command found in .ci/run"
    for command in commands:
        words = shlex.split(command)
        program = Path(words[0]).name
        # `.venv/bin/mmrl support-matrix --check ...` appears as `mmrl support-matrix --check ...`
        shown = " ".join([program if program in ("mmrl",) else words[0], *words[1:]])
        assert shown in test_section or command in test_section, f"README's Test section omits {command!r}"


@pytest.mark.slow
def test_readme_parameter_count_is_the_recipes_model():
    from mmrl import build_model
    from mmrl.config import load_recipe

    model = load_recipe(REPO / "recipes" / "tiny_vlm_count.yaml").model
    built = build_model(model.path, random_init=model.random_init, config_overrides=model.config_overrides,
                        tiny_vocabulary=model.tiny_vocabulary)
    count = sum(p.numel() for p in built.model.parameters())
    assert f"model of {count:,} parameters" in README, f"the recipe's model has {count:,} parameters"


def test_every_results_file_the_docs_cite_exists():
    """A figure the README or a page under docs/ quotes from `bench/results/X.json` can be
    checked there: the file exists (a path after `--out` is where a bench is told to write,
    not a citation)."""
    cited = {(doc.name, match.group(1))
             for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
             for match in re.finditer(r"(?<!--out )(bench/results/[\w.-]+\.json)", doc.read_text())}
    missing = sorted(f"{doc}: {path}" for doc, path in cited if not (REPO / path).exists())
    assert cited and not missing, f"results files cited but not in bench/results/: {missing}"


def _shown_equals(shown: str, value: float) -> bool:
    """`shown` ("63.7", "0.97") is `value` rounded to the digits it shows (half a unit of the
    last digit either way: 1.335 is shown 1.34 though it is stored a hair below)."""
    digits = len(shown.partition(".")[2])
    return abs(float(shown) - value) <= 0.5 * 10 ** -digits + 1e-9


# docs/performance.md's timing tables and the results entries each row quotes, column by column.
TIMING_TABLES = {
    "bench/results/first_steps_gpu.json": (
        "| run | 30 steps |", ("calls", "static_first_trace_8615612", "runs"),
        {"empty compile cache": "new1", "second run": "new2"},
        ("all_steps_s", "compile_total_s", "compile_graphs_total", "first_step_s", "median_step_s")),
    "bench/results/decode_ab_text_gpu.json": (
        "| decode step | 50 steps |", ("summary",),
        {"graphs, empty cache": "mmrl_graphs", "compiled, empty cache": "mmrl_compiled",
         "compiled, second run": "mmrl_compiled_warm", "graphs through the engine's": "mmrl_graphs_layers_triton_warm",
         "graphs recorded through": "mmrl_graphs_recorded_through_layers"},
        ("whole_run_s", "first_step_s", "compile_or_record_s", "median_step_s")),
}


@pytest.mark.parametrize("results_file", sorted(TIMING_TABLES))
def test_timing_tables_are_their_results_files(results_file):
    """Each row of docs/performance.md's compile-cost and decode-step tables quotes its
    entry of the results file, to the digits shown (written by bench/first_steps.sh and
    bench/decode_ab.sh on the device)."""
    import json

    header, path, rows, keys = TIMING_TABLES[results_file]
    entries = json.loads((REPO / results_file).read_text())
    for key in path:
        entries = entries[key]
    table = PERFORMANCE[PERFORMANCE.index(header):].split("\n\n")[0].splitlines()[2:]
    assert len(table) == len(rows), table
    for line, (label, entry) in zip(table, rows.items()):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert cells[0].startswith(label), (cells[0], label)
        shown = re.findall(r"\d+(?:\.\d+)?", " ".join(cells[1:]))
        measured = [entries[entry][key] for key in keys]
        assert len(shown) == len(measured) and all(_shown_equals(s, v) for s, v in zip(shown, measured)), (
            f"{line} shows {shown}; {results_file} holds {measured}")


def test_shared_media_figures_are_their_results_files():
    """Each row of docs/performance.md's shared-media table quotes the results file it names
    (written by bench/media_sharing.py), to the digits it shows."""
    import json

    rows = [line for line in PERFORMANCE.splitlines() if "bench/results/media_sharing" in line and line.startswith("|")]
    assert len(rows) >= 3
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        results = json.loads((REPO / re.search(r"`(bench/results/[\w.]+\.json)`", row).group(1)).read_text())
        measured = [results["plain_over_shared"][k] for k in ("update", "logprob", "rollout")]
        measured.append(results["total_plain_over_shared"])
        for shown, value in zip(cells[1:5], measured):
            digits = len(shown.rstrip("x").partition(".")[2])
            assert shown == f"{value:.{digits}f}x", f"{shown} for {value:.3f} in: {row}"


def test_readme_recipe_figures_are_the_bench_results():
    """README's per-seed steps and seconds are bench/results/tiny_vlm_recipe.json's
    (written by bench/tiny_vlm_recipe.py)."""
    import json

    runs = json.loads((REPO / "bench" / "results" / "tiny_vlm_recipe.json").read_text())["runs"]
    seeds = "/".join(str(r["seed"]) for r in runs)
    steps = "/".join(str(r["steps"]) for r in runs)
    walls = "/".join(f"{r['wall_s']:.0f}" for r in runs)
    text = " ".join(README.split())
    assert f"seeds {seeds} took {steps} steps and {walls} s" in text


def test_readme_gpu_table_is_gpu_targets_json():
    """README's H200 table is bench/results/gpu_targets.json as bench/gpu_targets.py renders it."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("gpu_targets", REPO / "bench" / "gpu_targets.py")
    targets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(targets)
    summary = json.loads((REPO / "bench" / "results" / "gpu_targets.json").read_text())
    assert f"{targets.TABLE_START}\n{targets.readme_table(summary)}\n{targets.TABLE_END}" in README


def test_the_geometry3k_spread_reads_the_numbered_fresh_runs_only(tmp_path):
    """bench/gpu_targets.py's geometry3k rows read the fresh-machine runs in the order measured
    (no number, then _2_, _3_, ..., _10_), not a proxy saved beside them under another name."""
    from bench_scripts import load_bench

    targets = load_bench("gpu_targets")
    names = ["decode_graphs_vl3b_geometry3k_gpu_raw.json", "decode_graphs_vl3b_geometry3k_10_gpu_raw.json",
             "decode_graphs_vl3b_geometry3k_2_gpu_raw.json", "decode_graphs_vl3b_geometry3k_bf16_h100_oom_gpu_raw.json"]
    for name in names:
        (tmp_path / name).write_text("{}")
    assert [path.name for path in targets.spread_runs(tmp_path)] == [names[0], names[2], names[1]]
    warm = ["decode_graphs_warm_vl3b_geometry3k_gpu_raw.json", "decode_graphs_warm_vl3b_geometry3k_2_gpu_raw.json",
            "decode_graphs_warm_vl3b_geometry3k_h100_oom_gpu_raw.json"]
    for name in warm:
        (tmp_path / name).write_text("{}")
    assert [path.name for path in targets.spread_runs(tmp_path, "decode_graphs_warm_vl3b_geometry3k")] == warm[:2]


def test_gpu_targets_json_holds_what_its_readers_compute_from_the_results():
    """Each reader-made row of bench/results/gpu_targets.json is what its reader computes
    from the results on file now (a result replaced without re-running gpu_targets.py fails)."""
    import json

    from bench_scripts import load_bench

    targets = load_bench("gpu_targets")
    rows = {row["name"]: row for row in json.loads((REPO / "bench" / "results" / "gpu_targets.json").read_text())["targets"]}
    readers = (targets.multi_turn_entry, targets.overlap_entry, targets.overlap_vl_entry,
               targets.recipe_recheck_entry, targets.geo3k_entry, targets.second_run_entry, targets.recheck_entry)
    for read in readers:
        entry = read()
        assert entry is not None and rows[entry["name"]] == json.loads(json.dumps(entry)), read.__name__
    spread = targets.spread_entries() + targets.spread_warm_entries()
    assert len(spread) == 6
    for entry in spread:
        assert rows[entry["name"]] == json.loads(json.dumps(entry)), entry["name"]
    geo3k = targets.geo3k_entry()
    assert geo3k["met"] is (geo3k["measured"] >= 3000)


def test_the_second_run_geometry3k_rows_count_later_compiles_and_the_share(tmp_path):
    """bench/gpu_targets.py's second-run geometry3k rows: graphs compiled after step 1 and the
    compile seconds over the steps' wall clock, each against its target; none without a run."""
    import json

    from bench_scripts import load_bench

    targets = load_bench("gpu_targets")
    path = tmp_path / "warm.json"
    assert targets.spread_warm_entries([path]) == []
    run = {"steps_done": 50, "whole_run_s": 120.0, "compile_total_s": 9.0, "compile_graphs_total": 6,
           "first_step_s": 11.0, "median_s": {"step": 2.2},
           "per_step": [{"compile_graphs": 5}, {"compile_graphs": 0}, {"compile_graphs": 1}]}
    path.write_text(json.dumps({"runs": {"mmrl_graphs_warm": run}}))
    first, later, share = targets.spread_warm_entries([path])
    assert (first["measured"], first["met"]) == (11.0 - 2.2, True)
    assert (later["measured"], later["met"]) == (1, True)
    assert (share["measured"], share["met"]) == (0.075, True)
    run.update(compile_total_s=13.0, per_step=[{"compile_graphs": 5}] + [{"compile_graphs": 1}] * 4)
    path.write_text(json.dumps({"runs": {"mmrl_graphs_warm": run}}))
    first, later, share = targets.spread_warm_entries([path])
    assert (later["measured"], later["met"], share["met"]) == (4, False, False)
    # Of two runs, the one with the larger first-step gap is the entry; the other is in its note.
    again = tmp_path / "warm_2.json"
    again.write_text(json.dumps({"runs": {"mmrl_graphs_warm": dict(run, first_step_s=14.0, compile_total_s=6.0)}}))
    first, later, share = targets.spread_warm_entries([path, again])
    assert (round(first["measured"], 6), first["met"], share["met"]) == (round(14.0 - 2.2, 6), False, True)
    assert "the other runs: first step 8.8 s over the median" in first["note"] and "(warm.json)" in first["note"]
