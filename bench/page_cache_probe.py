"""Does a fresh machine's first step wait on the CUDA libraries' pages? (issue 28)

On one H200 the first run of a call took 36.2 s for its first step where the second took
26.3 s (startup 32.3 against 21.4 s, media check 5.4 against 2.4 s): the second finds the
libraries' files in the page cache. This times a child process's first CUDA work (import,
the first matrix products, a few eager transformer layers forward and backward under bf16
autocast, a 3-D convolution through cuDNN, attention) with the libraries (`mmrl.page_cache.
library_files`) as the machine has them, then again warm, then evicted (cold), then evicted
and read through first (`mmrl.page_cache.read_files`, what the trainer does in a thread).

    python bench/page_cache_probe.py --out $OUT/page_cache_probe_gpu.json
    .venv/bin/python bench/page_cache_probe.py --device cpu --out /tmp/page_cache_probe.json   # structure on CPU

Writes JSON: the libraries' bytes and resident share at the start, and per case each
phase's seconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHILD = r"""
import json, sys, time
began = time.perf_counter()
phases = {}
def mark(name):
    global began
    now = time.perf_counter(); phases[name] = round(now - began, 3); began = now
import torch
mark("import_torch")
device = torch.device(sys.argv[1])
sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
x = torch.randn(256, 256, device=device); sync(); mark("device_init")
(x @ x).sum().item(); mark("first_matmul")
layers = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True, norm_first=True)
                             for _ in range(4)).to(device)
h = torch.randn(4, 300, 1024, device=device, requires_grad=True); sync(); mark("layers_built")
with torch.autocast(device.type, dtype=torch.bfloat16):
    out = h
    for layer in layers:
        out = layer(out)
    out.float().pow(2).mean().backward()
sync(); mark("layers_forward_backward")
conv = torch.nn.Conv3d(3, 1280, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=False).to(device)
with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
    conv(torch.randn(1024, 3, 2, 14, 14, device=device)).sum().item()
mark("conv3d")
q = torch.randn(4, 16, 300, 64, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().item(); mark("attention")
print(json.dumps(phases))
"""


def child(device: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, device], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return {"error": done.stderr[-1500:]}
    phases = json.loads(done.stdout.strip().splitlines()[-1])
    phases["total"] = round(sum(phases.values()), 3)
    return phases


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import torch  # noqa: F401 - maps the libraries the listing reads

    from mmrl.page_cache import evict, library_files, read_files, resident_fraction
    from mmrl.platform_info import write_report

    paths = library_files()
    sizes = {str(p): p.stat().st_size for p in paths}
    resident = {str(p): resident_fraction(p) for p in paths}
    known = [(sizes[k], v) for k, v in resident.items() if v is not None]
    report = {"command": "python bench/page_cache_probe.py " + " ".join(argv or sys.argv[1:]),
              "libraries": len(paths), "library_bytes": sum(sizes.values()),
              "resident_at_start": round(sum(s * f for s, f in known) / max(1, sum(s for s, _ in known)), 3),
              "files": [{"path": k, "bytes": sizes[k], "resident": resident[k]} for k in sizes], "cases": {}}
    report["cases"]["as_found"] = child(args.device)
    report["cases"]["warm"] = child(args.device)
    evict(paths)
    report["cases"]["evicted"] = child(args.device)
    evict(paths)
    began = time.perf_counter()
    read = read_files(paths)
    report["read_s"], report["read_bytes"] = round(time.perf_counter() - began, 3), read
    report["cases"]["evicted_then_read"] = child(args.device)
    print(f"{len(paths)} libraries, {report['library_bytes'] / 1e9:.2f} GB, {report['resident_at_start']:.0%} "
          f"resident at the start; read through in {report['read_s']} s")
    names = list(report["cases"]["warm"])
    print("case".ljust(20) + "".join(name[:14].rjust(15) for name in names))
    for case, phases in report["cases"].items():
        print(case.ljust(20) + "".join(str(phases.get(name, "-")).rjust(15) for name in names))
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
