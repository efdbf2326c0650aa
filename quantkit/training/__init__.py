"""Training: `quantkit train`.

- `config.py`: the training YAML, validated key by key before any work (no torch).
- `loop.py`: the DDP training loop (global batch, accumulation, evaluation, checkpoints, resume).
- `qat.py`: quantization-aware training: torchao fake quantizers for a recipe's scheme; the QAT marker `finalize` reads.
- `checkpoint.py`: resumable checkpoints (Hugging Face directories plus the trainer's state).

Imports anything below it: `quantkit.models`, `quantkit.quant`, `quantkit.algorithms`, `quantkit.export`,
`quantkit.evaluation` (evaluation during training), `quantkit.runtime`, `quantkit.data`, `quantkit.errors`.
"""
