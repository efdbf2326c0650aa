"""What a recipe makes of a model, built on the grid layer (`quantkit.grids`), `quantkit.algorithms` and
`quantkit.models`; one floor of the package:
- `registry.py`: recipes (the YAML files under `recipes/`): parse, validate, list, resolve; no torch.
- `plan.py`: the recipe applied to a model: which module gets which scheme, and why others are left out.
- `gguf_mixtures.py`: llama.cpp's named mixtures (which tensor gets which K type).
- `kv_cache.py`: the KV cache's FP8 scales: observed, computed with, loaded.
- `quantized_model.py`: what quantization produces and every exporter writes.
- `rotations.py`: a recipe's fused rotations applied to a model as its weights are read.
- `fake_quant.py`: fake quantizers exact to a scheme's grid (QAT trains through them; learned rotations learn against
  them), installed on a plan's Linears (`QATLinear`).
"""
