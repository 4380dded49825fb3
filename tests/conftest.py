"""Shared fixtures: the registered families and fresh tiny builds of each; the bench
script a bench test module runs; the torch threads of each test process; the order the
tests are queued in (the longest first).

Under pytest-xdist (`-n auto`: README.md's test command) every worker gets its share of
the cores, one thread on a machine with as many cores as workers, and the processes it
starts (torchrun ranks, `mmrl train`) inherit that share through OMP_NUM_THREADS and
MMRL_MAX_THREADS, which caps a recipe's `trainer.threads` (mmrl/logs.py). Without xdist
the one process takes up to 2 threads, as before.
"""

import os

from mmrl.logs import MAX_THREADS_ENV, share_cpu

share_cpu()  # OpenMP threads sleep while they wait: before torch loads (mmrl/logs.py)

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, len(os.sched_getaffinity(0)) // WORKERS))
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))  # read when torch loads, here and in subprocesses
    os.environ.setdefault(MAX_THREADS_ENV, str(THREADS))

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(THREADS)

from bench_scripts import bench_on_path  # noqa: E402
from mmrl.registry import families  # noqa: E402

FAMILIES = [a.family for a in families()]
VLM_FAMILIES = [a.family for a in families() if a.is_multimodal]


@pytest.fixture
def tmp_ckpt(tmp_path):
    return tmp_path / "ckpt"


@pytest.fixture(scope="module")
def bench(request):
    """bench/<BENCH_SCRIPT>.py of the test module (`BENCH_SCRIPT = "decode_bound"`),
    imported with bench/ on the import path while the module's tests run, as when the
    script runs (it imports its neighbours)."""
    name = getattr(request.module, "BENCH_SCRIPT", None)
    if name is None:
        pytest.fail(f"{request.module.__name__} takes the bench fixture without naming BENCH_SCRIPT")
    with bench_on_path(name) as script:
        yield script


@pytest.fixture
def plugin_path(tmp_path):
    """`tmp_path` on sys.path for an out-of-tree family (what `mmrl add-model --out`
    writes); afterwards its families are unregistered and its modules forgotten."""
    import importlib
    import sys

    from mmrl.registry import unregister

    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]
            for attr in vars(module).values():
                if isinstance(attr, type) and attr.__module__ == name and hasattr(attr, "family"):
                    unregister(attr.family)
    importlib.invalidate_caches()


def pytest_itemcollected(item):
    """A test that starts torchrun processes is slow too: out of the quick tier
    (`-m "not slow and not gpu"`, README.md), first in the queue."""
    if item.get_closest_marker("multiprocess") and not item.get_closest_marker("slow"):
        item.add_marker(pytest.mark.slow)


# The longest tests, longest first (names without parameters; a CI run's `--durations=40`,
# 2026-12-03): under `--dist worksteal` the first worker's queue starts with them and the
# other worker steals from that queue's end, so the longest run first instead of one of
# them starting last and running on alone.
LONGEST = [
    "tests/test_vllm.py::test_count_recipe_learns_with_the_vllm_backend",
    # Its module's tests share one fixture of two processes (the dry run of every device call).
    "tests/test_bench_two_gpus.py::test_every_part_ends_well_on_cpu",
    "tests/test_prewarm.py::test_the_run_finds_the_helpers_compiles_in_the_cache",
    "tests/test_add_model.py::test_coverage_sweep_slice_writes_rows_and_resumes",
    "tests/test_recipe.py::test_tiny_vlm_recipe_learns_to_count_from_the_image",
    "tests/test_add_model.py::test_vision_language_scaffolds_read_what_their_processor_and_model_code_need",
    "tests/test_disaggregated.py::test_one_rollout_rank_and_one_train_rank_and_a_resumed_run_trains_each_batch_once",
    "tests/test_probes.py::test_plugin_family_adds_its_row_and_changes_nothing_else",
    "tests/test_ulysses.py::test_data_and_sequence_parallel_equals_data_parallel",
    "tests/test_add_model.py::test_vision_language_scaffold_passes_the_zoo_unedited",
    "tests/test_vllm.py::test_vllm_probe_verifies_a_scaffolded_family",
    "tests/test_vllm.py::test_each_rank_runs_its_own_engine_under_torchrun",
    "tests/test_bad_inputs.py::test_a_failing_reward_is_one_line_and_leaves_no_checkpoint",
    "tests/test_vllm.py::test_training_under_torchrun_with_the_vllm_backend",
    "tests/test_export_checkpoints.py::test_a_sharded_lora_run_saves_its_adapter_and_resumes_exactly",
    "tests/test_rollout_sharded.py::test_two_process_compiled_rollout_equals_one_process",
    "tests/test_buffer.py::test_two_process_one_step_off_run_writes_each_ranks_share",
    "tests/test_bench_device_ab.py::test_each_side_runs_its_own_tree_and_is_compared_with_the_first",
    "tests/test_ulysses.py::test_probe_runs_every_family_in_one_launch",
    "tests/test_ulysses.py::test_training_with_sequence_parallel_equals_one_process",
    "tests/test_reliability.py::test_sigkill_at_random_points_then_resume_equals_an_uninterrupted_run",
    # In process since (their docstrings say why): shorter than the ones above, still long.
    "tests/test_probes.py::test_doctor_fails_a_family_that_breaks_its_contract",
    "tests/test_probes.py::test_doctor_on_a_checkpoint",
]
RANK = {name: rank for rank, name in enumerate(LONGEST)}


def _urgency(item) -> tuple[int, bool]:
    return RANK.get(item.nodeid.split("[")[0], len(LONGEST)), item.get_closest_marker("slow") is None


def _module_fixture_users(item) -> bool:
    """Whether the test takes a module-scoped fixture (pytest's own record of the
    fixtures a test resolves to)."""
    resolved = getattr(item, "_fixtureinfo", None)  # on every test function; absent on other kinds of item
    return resolved is not None and any(definitions[-1].scope == "module"
                                        for definitions in resolved.name2fixturedefs.values())


@pytest.hookimpl(trylast=True)  # after pytest has grouped the tests that share a parametrized fixture
def pytest_collection_modifyitems(config, items):
    """The longest tests first (LONGEST), then the other slow ones, then the quick tier (a
    stable sort keeps their order otherwise): under xdist the long end-to-end runs start
    while the other workers take the quick tests, instead of one of them starting last and
    running on alone. The tests of a module that share a module-scoped fixture move
    together, to the place of the most urgent of them: split apart, pytest would build
    the fixture again for each part (a training run, a bench under torchrun)."""
    urgency = {item: _urgency(item) for item in items}
    shared = {}
    for item in items:
        if _module_fixture_users(item):
            module = item.nodeid.split("::")[0]
            shared[module] = min(shared.get(module, urgency[item]), urgency[item])
    for item in items:
        if _module_fixture_users(item):
            urgency[item] = shared[item.nodeid.split("::")[0]]
    items.sort(key=urgency.__getitem__)


@pytest.fixture
def collector_off():
    """A block with Python's cyclic collector off: what goes inside it is freed by reference
    counts alone (as for what a run froze after compiling, `trainer.gc_freeze`)."""
    import contextlib
    import gc

    @contextlib.contextmanager
    def off():
        was = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if was:
                gc.enable()

    return off


@pytest.fixture
def fused_graphs(monkeypatch):
    """The chunked head's fused functions (`mmrl.engine.fusion.on_cuda`) compiled on the CPU too,
    through a backend that counts their graphs (the list yielded) and runs them eagerly; their
    compiled state and dynamo's caches cleared before and after."""
    from mmrl.engine import fusion, logprobs

    compiled = []

    def counting(graph, example_inputs):
        compiled.append(graph)
        return graph.forward

    monkeypatch.setattr(fusion, "compiles_here", lambda tensor: True)
    monkeypatch.setattr(fusion, "COMPILE_OPTIONS", {"backend": counting})
    functions = (logprobs._stats, logprobs._raw_grad)
    for function in functions:
        function.state.clear()
    torch._dynamo.reset()
    yield compiled
    for function in functions:
        function.state.clear()
    torch._dynamo.reset()
