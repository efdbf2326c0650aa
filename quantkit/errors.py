"""Typed errors. The library raises them; the CLI maps each to a one-line message and an exit code."""


class QuantkitError(Exception):
    """Base class. `exit_code` is what the CLI exits with; the message says what to do."""

    exit_code = 1


class UsageError(QuantkitError):
    """The user asked for something that cannot work as given (exit 2)."""

    exit_code = 2


class RecipeNotFoundError(UsageError):
    pass


class RecipeError(UsageError):
    """A recipe file is invalid: the message names the field and what is allowed."""


class SourceModelError(UsageError):
    """SRC is missing or is not a Hugging Face causal-LM directory."""


class DestinationExistsError(UsageError):
    pass


class UnsupportedModelError(UsageError):
    """The model's layout is not one calibration knows (`quantkit.models.architectures`)."""


class DataError(UsageError):
    """A dataset path or spec cannot be read, or gives no tokens."""


class HardwareError(UsageError):
    """The recipe/format needs hardware or packages this machine lacks."""


class FormatError(UsageError):
    """The recipe cannot be written in the requested output format."""


class CalibrationError(QuantkitError):
    """Calibration produced a broken layer (non-finite outputs, or errors as large as the signal): the run stops
    naming it rather than write an artifact that computes garbage."""


class ExportError(QuantkitError):
    """Writing the artifact failed."""


class GateFailedError(QuantkitError):
    """A model degraded beyond the accuracy budget (exit 3)."""

    exit_code = 3


class InterruptedRunError(QuantkitError):
    """Ctrl-C during calibration, with finished layers saved for `--resume` (exit 130, like any interrupt)."""

    exit_code = 130
