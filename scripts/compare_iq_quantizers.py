"""quantkit's codebook i-quant quantizer (`grids.iq_low`) against llama.cpp's own (ggml's `ggml_quantize_chunk`, the
function llama-quantize calls), on the same weights and importance matrix: the imatrix-weighted relative error and
the relative output error on the activations the imatrix came from, both files decoded by the gguf package.

    .venv/bin/python scripts/compare_iq_quantizers.py --ggml PATH/libggml-base.so [IQ2_XXS IQ1_S ...]

`--ggml`: a libggml-base shared library (llama-cpp-python's wheel holds one, llama_cpp/lib/libggml-base.so).
Measured (64 x 1024 Gaussian weights with column scales, activations with per-column scales, 4096 tokens):
imatrix-weighted error quantkit / llama.cpp IQ3_XXS 0.0235 / 0.0263, IQ3_S 0.0145 / 0.0172, IQ2_XXS 0.0916 / 0.1019,
IQ2_XS 0.0667 / 0.0767, IQ2_S 0.0545 / 0.0619, IQ1_S 0.210 / 0.238, IQ1_M 0.161 / 0.181.
"""

from __future__ import annotations

import argparse
import ctypes

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from quantkit.grids.iq_low import NAMES, quantize_codebook


def llama_cpp(lib, w: np.ndarray, qtype: GGMLQuantizationType, importance: np.ndarray) -> np.ndarray:
    rows, cols = w.shape
    block, size = GGML_QUANT_SIZES[qtype]
    out = np.zeros(rows * cols // block * size, np.uint8)
    lib.ggml_quantize_init(int(qtype))
    w, importance = np.ascontiguousarray(w, np.float32), np.ascontiguousarray(importance, np.float32)
    lib.ggml_quantize_chunk(int(qtype), w.ctypes.data, out.ctypes.data, 0, rows, cols, importance.ctypes.data)
    return dequantize(out.reshape(rows, -1), qtype).reshape(rows, cols)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ggml", required=True, help="path of libggml-base.so")
    parser.add_argument("types", nargs="*", default=list(NAMES))
    args = parser.parse_args()
    lib = ctypes.CDLL(args.ggml)
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    torch.manual_seed(0)
    rows, cols = 64, 1024
    w = torch.randn(rows, cols) * (1 + 3 * torch.rand(cols))
    x = torch.randn(4096, cols) * (0.2 + torch.rand(cols) * 2)
    importance = (x * x).mean(0)

    def weighted(v: torch.Tensor) -> float:
        return float((((v - w) ** 2) * importance).sum() / ((w ** 2) * importance).sum())

    def output(v: torch.Tensor) -> float:
        return float(((x @ (v - w).T) ** 2).mean() / ((x @ w.T) ** 2).mean())

    for name in args.types:
        qtype = GGMLQuantizationType[name.upper()]
        codes, params = quantize_codebook(w, qtype, importance)
        mine = params.dequantize(codes)
        theirs = torch.from_numpy(llama_cpp(lib, w.numpy(), qtype, importance.numpy()))
        print(f"{qtype.name}: imatrix-weighted relative error quantkit {weighted(mine):.5f}, llama.cpp {weighted(theirs):.5f}; "
              f"output error {output(mine):.5f}, {output(theirs):.5f}")


if __name__ == "__main__":
    main()
