"""Runs in mlx's environment (tests/engines/test_mlx_lm.py starts it with MLX_PYTHON): mlx's own reading of a quantkit
MLX directory. Imports nothing of quantkit's.

    mlx_worker.py dequantize DIR OUT.npz   every quantized tensor of DIR dequantized by mx.dequantize: its scales and
                                           biases in float32 (`NAME`), and as stored (`NAME@stored`), in float32
    mlx_worker.py quantize IN.npz OUT.npz  mx.quantize of each array (`NAME` float32, `NAME@dtype`, `NAME@bits`,
                                           `NAME@group`, `NAME@mode`: affine when absent): its scales (as stored for
                                           nvfp4 / MX: uint8), biases (affine) and codes
    mlx_worker.py logits DIR IDS OUT.npy   mlx_lm.utils.load(DIR)'s logits on the token ids IDS (comma-separated)
    mlx_worker.py wide DIR IDS OUT.npy     the same model dequantized by mlx-lm (`dequantize_model`, scales and biases
                                           widened to float32 first), its weights rounded to the file's dtype (as the
                                           model holds them), run in float32
"""

import glob
import sys

import mlx.core as mx
import numpy as np


def dequantize(directory: str, out: str) -> None:
    import json

    weights = {}
    for file in glob.glob(f"{directory}/model*.safetensors"):
        weights.update(mx.load(file))
    quantization = json.load(open(f"{directory}/config.json"))["quantization"]
    result = {}
    for name in [n[: -len(".scales")] for n in weights if n.endswith(".scales")]:
        own = quantization.get(name, quantization)
        w, s = weights[f"{name}.weight"], weights[f"{name}.scales"]
        args = dict(group_size=own["group_size"], bits=own["bits"], mode=own["mode"])
        if own["mode"] != "affine":  # MX: E8M0 exponents, no biases; FP4 / FP8 values times powers of two are exact
            result[name] = result[f"{name}@stored"] = np.array(mx.dequantize(w, s, **args, dtype=mx.float32))
            continue
        b = weights[f"{name}.biases"]
        wide = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), **args)
        result[name] = np.array(wide)
        result[f"{name}@stored"] = np.array(mx.dequantize(w, s, b, **args).astype(mx.float32))
    np.savez(out, **result)


def quantize(source: str, out: str) -> None:
    arrays = np.load(source)
    dtypes = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
    result = {}
    for name in [n for n in arrays.files if "@" not in n]:
        w = mx.array(arrays[name]).astype(dtypes[str(arrays[f"{name}@dtype"])])
        mode = str(arrays[f"{name}@mode"]) if f"{name}@mode" in arrays.files else "affine"
        args = dict(group_size=int(arrays[f"{name}@group"]), bits=int(arrays[f"{name}@bits"]), mode=mode)
        if mode != "affine":  # no biases; the scales' bytes as stored
            q, s = mx.quantize(w, **args)
            result[f"{name}.weight"], result[f"{name}.scales"] = np.array(q), np.array(s)
            continue
        q, s, b = mx.quantize(w, **args)
        result[f"{name}.weight"] = np.array(q)
        result[f"{name}.scales"] = np.array(s.astype(mx.float32))
        result[f"{name}.biases"] = np.array(b.astype(mx.float32))
    np.savez(out, **result)


def logits(directory: str, ids: str, out: str, wide: bool = False) -> None:
    from mlx.utils import tree_map
    from mlx_lm.utils import dequantize_model, load

    model, _ = load(directory)
    if wide:
        dtype = model.model.norm.weight.dtype
        widen = lambda p: p.astype(mx.float32) if p.dtype == dtype else p  # noqa: E731 (not MX's uint8 scales)
        model.update(tree_map(widen, model.parameters()))
        model = dequantize_model(model)
        model.update(tree_map(lambda p: p.astype(dtype).astype(mx.float32), model.parameters()))
    tokens = mx.array([[int(i) for i in ids.split(",")]])
    np.save(out, np.array(model(tokens).astype(mx.float32))[0])


if __name__ == "__main__":
    commands = {"dequantize": dequantize, "quantize": quantize, "logits": logits,
                "wide": lambda *args: logits(*args, wide=True)}
    commands[sys.argv[1]](*sys.argv[2:])
