"""The bench/ scripts as modules, for the tests that run them on CPU (bench/ is not a
package: each script imports its neighbours from its own folder).

    packing = load_bench("packing")
"""

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str):
    """bench/<name>.py imported under `name`."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
