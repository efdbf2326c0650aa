"""Training: `quantkit train`.

- `config.py`: the training YAML, validated key by key before any work (no torch).
- `loop.py`: the DDP training loop (global batch, accumulation, evaluation, checkpoints, resume).
- `qat.py`: quantization-aware training: the recipes it takes, the recipe it trains under, the Linears it fake-quantizes
  (the fake quantizers are `quantkit.quant.fake_quant`'s).
- `checkpoint.py`: resumable checkpoints (Hugging Face directories plus the trainer's state).

Imports anything below it: `quantkit.models`, `quantkit.quant`, `quantkit.algorithms`, `quantkit.export`,
`quantkit.evaluation` (evaluation during training), `quantkit.runtime`, `quantkit.data`, `quantkit.errors`.
"""
