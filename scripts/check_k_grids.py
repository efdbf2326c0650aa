"""Compare quantkit's K-quant grids (quant/k_grids.py) with llama.cpp's own quantizers, byte for byte.

Compiles ggml-quants.c from llama.cpp's source (the copy inside PyPI's llama-cpp-python sdist) with a small main
that calls quantize_q{2,3,4,5,6}_K (the reference quantizers without an imatrix, the _impl ones with), runs it on
random rows, and counts the bytes and blocks that differ from `quantize_k(...).ggml_blocks()`. Needs gcc; the unit
tests carry a digest of its output instead.

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcp && tar -xzf /tmp/lcp/*.tar.gz -C /tmp/lcp
    .venv/bin/python scripts/check_k_grids.py --ggml /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp/ggml

--cflags "-O2 -march=native" builds the reference with FMA contraction (ggml-base is built without -march on
x86, so llama-quantize rounds without it; an aarch64 build contracts by default).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES

from quantkit.grids.k_grids import K_QTYPES, quantize_k

HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <stdarg.h>
typedef size_t (*quantize_fn)(const float *, void *, int64_t, int64_t, const float *);
size_t quantize_q2_K(const float *, void *, int64_t, int64_t, const float *);
size_t quantize_q3_K(const float *, void *, int64_t, int64_t, const float *);
size_t quantize_q4_K(const float *, void *, int64_t, int64_t, const float *);
size_t quantize_q5_K(const float *, void *, int64_t, int64_t, const float *);
size_t quantize_q6_K(const float *, void *, int64_t, int64_t, const float *);
static size_t block_bytes(int type) { return type == 10 ? 84 : type == 11 ? 110 : type == 12 ? 144 : type == 13 ? 176 : 210; }
/* the three ggml.c symbols ggml-quants.c links against */
void ggml_abort(const char * file, int line, const char * fmt, ...) { fprintf(stderr, "ggml_abort %s:%d\n", file, line); abort(); }
size_t ggml_row_size(int type, int64_t n) { return block_bytes(type) * (size_t)(n / 256); }
size_t ggml_type_size(int type) { return block_bytes(type); }
const char * ggml_type_name(int type) { (void)type; return "?"; }
static void * slurp(const char * path, size_t bytes) {
    void * data = malloc(bytes); FILE * f = fopen(path, "rb");
    if (!f || fread(data, 1, bytes, f) != bytes) { fprintf(stderr, "cannot read %s\n", path); exit(1); }
    fclose(f); return data;
}
int main(int argc, char ** argv) {  /* type rows cols weights.f32 out.bin [importance.f32] */
    int type = atoi(argv[1]); int64_t rows = atoll(argv[2]), cols = atoll(argv[3]);
    float * x = slurp(argv[4], sizeof(float) * rows * cols);
    float * importance = argc > 6 ? slurp(argv[6], sizeof(float) * cols) : NULL;
    quantize_fn fns[] = {quantize_q2_K, quantize_q3_K, quantize_q4_K, quantize_q5_K, quantize_q6_K};
    size_t bytes = block_bytes(type) * (size_t)(rows * cols / 256);
    void * out = malloc(bytes);
    fns[type - 10](x, out, rows, cols, importance);
    FILE * f = fopen(argv[5], "wb"); fwrite(out, 1, bytes, f); fclose(f);
    return 0;
}
"""


def build(ggml: Path, work: Path, cflags: str) -> Path:
    (work / "main.c").write_text(HARNESS)
    binary = work / "quantize_k"
    flags = cflags.split() + ["-DNDEBUG", f"-I{ggml / 'include'}", f"-I{ggml / 'src'}"]
    subprocess.run(["gcc", *flags, "-c", str(ggml / "src" / "ggml-quants.c"), "-o", str(work / "q.o")], check=True)
    subprocess.run(["gcc", *flags, str(work / "main.c"), str(work / "q.o"), "-lm", "-o", str(binary)], check=True)
    return binary


def test_weight(rows: int, cols: int, seed: int) -> np.ndarray:
    """Gaussian rows of varied magnitude with a few outlier columns, and the edge cases the searches branch on:
    a zero row, a constant row, positive and negative rows, a row of subnormal-small values, a sparse row."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((rows, cols)).astype(np.float32) * np.exp(rng.uniform(-6, 1, (rows, 1))).astype(np.float32)
    weight[:, rng.choice(cols, 4, replace=False)] *= 20
    weight[0] = 0
    weight[1] = 0.25
    weight[2] = np.abs(weight[2])
    weight[3] = -np.abs(weight[3])
    weight[4] *= np.float32(1e-30)
    weight[5] *= rng.random(cols) < 0.03
    return weight


def compare(binary: Path, work: Path, weight: np.ndarray, importance: np.ndarray | None, qtype, device: str) -> tuple[int, int, int, float]:
    rows, cols = weight.shape
    weight.tofile(work / "w.f32")
    args = [str(binary), str(int(qtype)), str(rows), str(cols), str(work / "w.f32"), str(work / "out.bin")]
    if importance is not None:
        importance.tofile(work / "i.f32")
        args.append(str(work / "i.f32"))
    subprocess.run(args, check=True)
    theirs = np.fromfile(work / "out.bin", dtype=np.uint8).reshape(rows, -1)
    start = time.perf_counter()
    ours = quantize_k(torch.from_numpy(weight).to(device), qtype,
                      None if importance is None else torch.from_numpy(importance).to(device)).ggml_blocks()
    seconds = time.perf_counter() - start
    type_bytes = GGML_QUANT_SIZES[qtype][1]
    differs = ours != theirs
    blocks = differs.reshape(-1, type_bytes).any(1)
    return int(differs.sum()), int(blocks.sum()), blocks.size, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ggml", type=Path, required=True, help="llama.cpp's ggml folder (holding src/ggml-quants.c)")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cflags", default="-O2")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        binary = build(args.ggml, work, args.cflags)
        weight = test_weight(args.rows, args.cols, args.seed)
        importance = np.random.default_rng(args.seed + 1).gamma(0.5, 1.0, args.cols).astype(np.float32)
        print(f"{args.rows} x {args.cols} rows, gcc {args.cflags}, quantkit on {args.device}")
        for qtype in K_QTYPES:
            for label, imatrix in (("ref", None), ("imatrix", importance)):
                nbytes, nblocks, total, seconds = compare(binary, work, weight, imatrix, qtype, args.device)
                print(f"{qtype.name:5} {label:8} bytes differing {nbytes:6d}  blocks {nblocks:5d} / {total}  ({seconds:.1f} s)")


if __name__ == "__main__":
    main()
