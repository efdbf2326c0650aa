"""quantkit: quantize large language models, from training to a deployable artifact.

Importing this package is cheap: torch and the model libraries are imported by the modules that need them.
"""

__version__ = "0.1.0"
