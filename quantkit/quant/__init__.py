"""Quantization's vocabulary, in two layers.

The grid, which `quantkit.algorithms` builds on:
- `schemes.py`: a scheme (weights, activations, KV cache) as frozen dataclasses; no torch.
- `float_grids.py`: FP8 / FP4 / MX grids; `qparams.py`: scales and zero points, quantize and dequantize.
- `observers.py`: activation statistics and the op each one reduces with across ranks.

What a recipe makes of a model, built on `quantkit.algorithms` and `quantkit.models`:
- `registry.py`: recipes (the YAML files under `recipes/`): parse, validate, list, resolve; no torch.
- `plan.py`: the recipe applied to a model: which module gets which scheme, and why others are left out.
- `kv_cache.py`: the KV cache's FP8 scales: observed, computed with, loaded.
- `quantized_model.py`: what quantization produces and every exporter writes.
- `fake_quant.py`: fake quantizers exact to a scheme's grid (QAT trains through them; learned rotations learn against
  them), installed on a plan's Linears (`QATLinear`).

Imports: `quantkit.errors`, `quantkit.runtime`; the second layer also `quantkit.algorithms` and `quantkit.models`.
"""
