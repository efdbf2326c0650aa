"""mlx-lm's side of `quantkit eval MLX_DIR` (`evaluation.mlx`): a standalone script run by a Python that has mlx and
mlx-lm (their own environment), importing nothing of quantkit's.

    python mlx_runner.py MODEL_DIR

loads the model with `mlx_lm.utils.load` and writes one line to stdout, `ready VOCAB MLX_VERSION MLX_LM_VERSION`; then,
for each line of token ids on stdin (space-separated), the model's logits for them (len(ids) x VOCAB float32,
little-endian); it ends with stdin. Errors go to stderr, and the exit status says so.
"""

import os
import sys

# this script's folder holds quantkit's evaluation/mlx.py, which `import mlx` would find before mlx itself
sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.path.dirname(os.path.abspath(__file__))]


def main(directory: str) -> None:
    import mlx.core as mx
    import numpy as np
    from mlx_lm import __version__ as mlx_lm_version
    from mlx_lm.utils import load

    model, _ = load(directory)
    vocab = model(mx.array([[0]])).shape[-1]
    out = sys.stdout.buffer
    out.write(f"ready {vocab} {mx.__version__} {mlx_lm_version}\n".encode())
    out.flush()
    for line in sys.stdin:
        ids = [int(token) for token in line.split()]
        logits = np.asarray(model(mx.array([ids])).astype(mx.float32))[0]
        out.write(np.ascontiguousarray(logits, dtype="<f4").tobytes())
        out.flush()


if __name__ == "__main__":
    main(sys.argv[1])
