"""Run `quantkit` under torchrun with rank 1 failing in its first calibrated layer (for the failure test)."""

import os
import sys

import quantkit.calibration.pipeline as pipeline

original = pipeline.calibrate_layer


def failing(*args, **kwargs):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("injected failure on rank 1")
    return original(*args, **kwargs)


pipeline.calibrate_layer = failing

from quantkit.cli.main import main  # noqa: E402

sys.argv = ["quantkit", *sys.argv[1:]]
main()
