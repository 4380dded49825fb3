"""The bench/ scripts as modules, for the tests that run them on CPU (bench/ is not a
package: each script imports its neighbours from its own folder).

    packing = load_bench("packing")
    with bench_on_path("decode_bound") as bench:   # a script that imports its neighbours
        bench.main([...])

A bench test module names its script, `BENCH_SCRIPT = "decode_bound"`, and takes the
`bench` fixture (tests/conftest.py: the script with bench/ on the path for the module);
`bench_report(bench, tmp_path_factory, [...])` runs it once and reads its JSON.
"""

import contextlib
import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str):
    """bench/<name>.py imported under `name`."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def bench_on_path(name: str):
    """bench/<name>.py imported with bench/ on the import path while the block runs, as
    when the script runs (it imports its neighbours, e.g. bench/timing.py)."""
    sys.path.insert(0, str(BENCH))
    try:
        yield load_bench(name)
    finally:
        sys.path.remove(str(BENCH))


def bench_report(bench, tmp_path_factory, args: list[str]) -> dict:
    """The report the bench's `main(args)` writes, to `--out` in a fresh folder."""
    out = tmp_path_factory.mktemp(bench.__name__) / f"{bench.__name__}.json"
    bench.main([*args, "--out", str(out)])
    return json.loads(out.read_text())
