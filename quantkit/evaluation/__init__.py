"""Evaluation: `quantkit eval`.

- `evaluate.py`: perplexity over strided windows, loading any model or artifact to evaluate, reports, the gate.
- `nll.py`: the loss of a batch of windows, lm_head's logits a chunk of tokens at a time (never a batch's full logits).
- `divergence.py`: `--kl-divergence`: each scored position's logits observed as the loss is computed, the first
  model's kept in a temporary file, every later model's KL divergence from them and top-1 agreement.
- `tasks.py`: lm-evaluation-harness tasks (`--tasks`) on an already-loaded model.
- `tensor_parallel.py`: `--tp N`: a model sharded with transformers' tensor-parallel plan.
- `artifacts.py`: which format's reader reads a MODEL (`export.reader_for`), and the engine that runs it where
  transformers does not; torch-free, for the CLI.
- `gguf.py`: GGUF's engine, reached through its reader: a .gguf file run in llama.cpp (llama-cpp-python, the `gguf`
  extra): checks, its token ids, a window's loss, its perplexity on quantkit's windows.
- `mlx.py`: MLX's engine, reached through its reader: an MLX directory run in mlx-lm, in the Python that has it
  (`mlx_runner.py`, a standalone script in a subprocess): checks, a window's loss, its perplexity on quantkit's windows.
- `report.py`: `--report FILE.html`: the results table as HTML, the Evaluation section of the page `finalize --report`
  wrote, or a page of its own; torch-free.

Imports anything below it: `quantkit.finalization` (`eval -q` previews a recipe in memory), `quantkit.export`,
`quantkit.models`, `quantkit.quant`, `quantkit.runtime`, `quantkit.data`, `quantkit.errors`; and on its own floor
`quantkit.budget.report` (the page `report.py` adds its table to).
"""
