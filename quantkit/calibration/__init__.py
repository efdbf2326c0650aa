"""Calibration: quantize a model decoder layer by decoder layer on calibration data.

pipeline.py (the layer loop) -> steps/ (one layer step per algorithm) -> quantkit.algorithms (the pure math);
hooks.py runs layers and observes their modules; layer.py holds what a step works on and what the run returns;
true_sequential.py is GPTQ's one staged pass per layer.
"""

from quantkit.calibration.layer import CalibrationResult
from quantkit.calibration.pipeline import calibrate

__all__ = ["CalibrationResult", "calibrate"]
