"""Time quantkit's K-quant quantizer (quant/k_grids.py) per type, optionally beside another copy of k_grids.py.

    .venv/bin/python scripts/bench_k_grids.py --shape 4096x4096 --threads 2
    git show HEAD~1:quantkit/quant/k_grids.py > /tmp/k_grids_old.py
    .venv/bin/python scripts/bench_k_grids.py --against /tmp/k_grids_old.py --types Q4_K Q6_K --imatrix

Each repeat runs `quantize_k` on the same Gaussian weight (seed 0) once per copy, side by side in one process, so
that both see the same machine load; the best of the repeats is reported. With --against, the two copies' GGUF
bytes must be equal (the script fails otherwise).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
import torch

from quantkit.grids import k_grids


def load_copy(path: Path):
    """Another k_grids.py, imported as its own module."""
    spec = importlib.util.spec_from_file_location("k_grids_against", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def timed(module, weight, qtype, importance) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    packed = module.quantize_k(weight, qtype, importance).ggml_blocks()
    return time.perf_counter() - start, packed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="4096x4096", help="rows x cols of the weight")
    parser.add_argument("--types", nargs="+", default=[q.name for q in k_grids.K_QTYPES])
    parser.add_argument("--imatrix", action="store_true", help="with a random importance per column (the _impl quantizers)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--against", type=Path, help="another k_grids.py to time beside this one")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows, cols = (int(n) for n in args.shape.lower().split("x"))
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)).to(args.device)
    importance = torch.rand(cols, generator=torch.Generator().manual_seed(1)).to(args.device) if args.imatrix else None
    other = load_copy(args.against) if args.against else None
    print(f"{rows} x {cols}, {'imatrix' if args.imatrix else 'reference'}, {args.threads} threads, {args.device}")
    for name in args.types:
        qtype = k_grids.Q[name]
        ours, theirs = [], []
        for _ in range(args.repeats):
            seconds, packed = timed(k_grids, weight, qtype, importance)
            ours.append(seconds)
            if other is not None:
                seconds, their_packed = timed(other, weight, qtype, importance)
                theirs.append(seconds)
                if not np.array_equal(packed, their_packed):
                    raise SystemExit(f"{name}: the bytes differ from {args.against}'s")
        line = f"{name:5} {min(ours):8.2f} s"
        if theirs:
            line += f"   against {min(theirs):8.2f} s   x{min(theirs) / min(ours):.1f}   bytes equal"
        print(line, flush=True)


if __name__ == "__main__":
    main()
