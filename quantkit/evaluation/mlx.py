"""An MLX directory measured in mlx-lm (`quantkit eval MLX_DIR`), in the Python that has mlx and mlx-lm: their own
environment, run as a subprocess (`mlx_runner.py`), so quantkit's environment needs neither.

Which Python: QUANTKIT_MLX_PYTHON where set, else ~/.cache/quantkit/mlx-venv/bin/python (what `make test-mlx` builds),
else quantkit's own where it has mlx-lm; without one, one line says what to install. The windows are quantkit's
(`evaluate.plan_windows`) on the Hugging Face rows' token ids (the directory's tokenizer is the source model's, copied
by `finalize`), and the loss is the same float32 cross-entropy, from mlx-lm's logits.

This is MLX's engine (`export.mlx_reader.ENGINE`): evaluation reaches it through the registry (`check_options`,
`positions`, `measure`). Nothing here imports torch or mlx at module level.
"""

from __future__ import annotations

import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Sequence

from quantkit.errors import HardwareError, SourceModelError, UsageError
from quantkit.export import config_json, mlx_reader
from quantkit.runtime.progress import QUIET, Progress

DEFAULT_VENV = Path.home() / ".cache" / "quantkit" / "mlx-venv"
RUNNER = Path(__file__).with_name("mlx_runner.py")
INSTALL_HINT = (f"python3 -m venv {DEFAULT_VENV} && {DEFAULT_VENV}/bin/pip install mlx-lm 'mlx[cpu]' (on Apple silicon: "
                "mlx-lm alone), or set QUANTKIT_MLX_PYTHON to a Python that has them")


@cache
def mlx_python() -> str:
    """The Python that has mlx and mlx-lm, or HardwareError (exit 2) saying how to get one."""
    from quantkit.runtime import environment

    named = environment.mlx_python()
    candidates = [named] if named else [str(DEFAULT_VENV / "bin" / "python"), sys.executable]
    for python in candidates:
        if Path(python).is_file() and subprocess.run([python, "-c", "import mlx.core, mlx_lm"], capture_output=True).returncode == 0:
            return python
    where = f"QUANTKIT_MLX_PYTHON={named} has" if named else "no Python here has"
    raise HardwareError(f"evaluating an MLX model needs mlx and mlx-lm, and {where} them: {INSTALL_HINT}")


def check_options(models: Sequence[str], tp: int = 1, max_acc_drop: float | None = None, device: str = "auto") -> None:
    """The MLX directories among `models`: refused with --tp (transformers' sharding), --max-acc-drop (lm-eval scores
    transformers models) and --device cuda (mlx runs on Apple's GPU or the CPU, its own choice); mlx-lm found."""
    found = [model for model in models if mlx_reader.detect(Path(model))]
    if not found:
        return
    if tp > 1:
        raise UsageError(mlx_reader.unsharded(found[0]))
    if max_acc_drop is not None:
        raise UsageError(f"--max-acc-drop gates --tasks scores, and {found[0]} has none (lm-eval scores transformers models); "
                         "gate it with --max-ppl-increase")
    if device.startswith("cuda"):
        raise UsageError(f"--device {device}: {found[0]} runs in mlx, on Apple's GPU or the CPU (mlx's choice); pass "
                         "--device auto")
    mlx_python()


def positions(path: str | Path) -> tuple[int | None, str]:
    return config_json(path).get("max_position_embeddings"), "max_position_embeddings in config.json"


class Runner:
    """mlx-lm with the model loaded, in its own process (`mlx_runner.py`): `logits(ids)` -> float32 [len(ids), vocab]."""

    def __init__(self, path: Path, threads: int):
        import os

        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.process = subprocess.Popen([mlx_python(), str(RUNNER), str(path)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        line = self.process.stdout.readline().decode().split()
        if not line or line[0] != "ready":
            raise SourceModelError(f"{path}: mlx-lm cannot load this MLX model ({self._error()})")
        self.vocab, self.versions = int(line[1]), f"mlx {line[2]}, mlx-lm {line[3]}"

    def _error(self) -> str:
        self.process.kill()
        lines = self.process.stderr.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else f"exit status {self.process.wait()}"

    def logits(self, ids: Sequence[int]):
        import numpy as np
        import torch

        self.process.stdin.write((" ".join(map(str, ids)) + "\n").encode())
        self.process.stdin.flush()
        size = len(ids) * self.vocab * 4
        data = self.process.stdout.read(size)
        if len(data) != size:
            raise SourceModelError(f"mlx-lm stopped while computing logits ({self._error()})")
        return torch.from_numpy(np.frombuffer(data, dtype="<f4").reshape(len(ids), self.vocab).copy())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.stdout.close()
        self.process.wait()
        self.process.stderr.close()


def window_nll(runner: Runner, tokens: Sequence[int], first_target: int, rows: int, observe=None) -> tuple[float, int]:
    """Summed float32 NLL of tokens[first_target:], each predicted by the position before it, `rows` positions at a
    time (as `nll.chunked_nll` sums it), each chunk's logits handed to `observe` where given."""
    from quantkit.evaluation.nll import decoded_nll

    return decoded_nll(runner.logits(tokens), tokens, first_target, rows, observe)


def windows_nll(runner: Runner, rows: int, inputs, labels, observe=None) -> tuple[float, int]:
    """`nll.NllFunction` over mlx-lm: each window (a row of `inputs`) computed alone."""
    from quantkit.evaluation.nll import decoded_windows_nll

    return decoded_windows_nll(window_nll, runner, rows, inputs, labels, observe)


def measure(label: str, texts: list[str], reference: tuple[list[int], str] | None, seq_len: int = 512,
            stride: int | None = None, max_samples: int | None = None, threads: int = 1, device: str = "cpu",
            progress: Progress = QUIET, logits=None, **_):
    """An MLX directory's perplexity in mlx-lm, on the Hugging Face rows' ids (else its own tokenizer's), one window
    at a time: an `evaluate.ModelReport`. The scored positions' logits go to `logits` too, where given."""
    from functools import partial

    import torch

    from quantkit.data import tokenize
    from quantkit.evaluation.evaluate import ModelReport, plan_windows, score_windows
    from quantkit.evaluation.nll import LOGITS_CHUNK_BYTES
    from quantkit.export import metadata
    from quantkit.finalization.preflight import peak_resident_bytes
    from quantkit.models.loading import load_tokenizer, weights_size
    from quantkit.models.sources import resolve_source

    path = resolve_source(label)
    ids = torch.tensor(reference[0], dtype=torch.long) if reference else tokenize(load_tokenizer(path), texts)
    seq_len, windows = plan_windows(ids.numel(), seq_len, stride, max_samples, positions(path)[0])
    runner = Runner(path, threads)
    try:
        rows = max(1, LOGITS_CHUNK_BYTES // (4 * runner.vocab))
        with torch.inference_mode():
            result = score_windows(partial(windows_nll, runner, rows), ids.reshape(-1), windows, seq_len,
                                   progress=progress, logits=logits)
    finally:
        runner.close()
    quantization = config_json(path).get("quantization") or {}
    mode = quantization.get("mode", "affine")
    fmt = f"mlx {quantization.get('bits')}-bit g{quantization.get('group_size')}" if mode == "affine" else f"mlx {mode}"
    recipe = ((metadata.read(path) or {}).get("recipe") or {}).get("name")
    return ModelReport(path=str(path), label=label, recipe=recipe, format=fmt, size_bytes=weights_size(path),
                       perplexity=result, peak_rss_per_rank=[peak_resident_bytes()], runtime=runner.versions)
