"""bench/green_overlap.py's workloads on CPU (the bench itself needs CUDA: green contexts,
CUDA graphs; its results are in bench/results/green_overlap*_gpu.json)."""

import importlib.util
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("green_overlap", REPO / "bench" / "green_overlap.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_decode_and_update_workloads_share_weights_and_keep_their_shapes():
    bench = _bench()
    weights, x_decode, x_update = bench.build(torch.device("cpu"), torch.float32, layers=2, hidden=16, ffn=40,
                                              rows=3, tokens=7)
    assert len(weights) == 2 and weights[0][0].shape == (16, 40) and weights[0][2].shape == (16, 16 + 512)
    out_decode, out_update = bench.forward(weights, x_decode), bench.forward(weights, x_update)
    assert out_decode.shape == (3, 16) and out_update.shape == (7, 16)
    # Row-wise: a decode row is the same computation as that row among the update's tokens.
    joined = bench.forward(weights, torch.cat([x_decode, x_update]))
    torch.testing.assert_close(joined[:3], out_decode, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out_update).all()


def test_modes_are_checked_before_any_device_work():
    import pytest

    bench = _bench()
    assert bench.chosen_modes(None, [16]) == [*bench.BASE_MODES, "green_16", "green_balanced_16"]
    assert bench.chosen_modes(["eager", "green_balanced_32"], [32]) == ["eager", "green_balanced_32"]
    with pytest.raises(SystemExit, match="--modes: unknown green_8"):
        bench.chosen_modes(["plain", "green_8"], [16])
