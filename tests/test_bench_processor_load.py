"""bench/processor_load.py on CPU with the tiny vocabulary: mmrl's load of a generic-class
VLM processor makes one tokenizer load against the handed path's two, with equal outputs."""

import json

from bench_scripts import bench_on_path


def test_processor_load_bench_counts_the_tokenizer_loads_and_compares_outputs(tmp_path):
    out = tmp_path / "processor_load.json"
    with bench_on_path("processor_load") as bench:
        assert bench.main(["--vocabulary", "tiny", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["same_outputs"] is True
    assert report["tokenizer_loads_per_processor"] == {"mmrl": 1.0, "handed": 2.0}
    assert set(report["median_s"]) == {"mmrl", "handed"} and report["speedup"] > 0
