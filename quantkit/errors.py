"""Typed errors. The library raises them; the CLI maps each to a one-line message and an exit code."""

import signal


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


class Terminated(KeyboardInterrupt):
    """SIGTERM (a `kill`, a CI job cancelled, a launcher stopping its ranks), met as Ctrl-C is: the run stops the
    way an interrupt does, keeps what `--resume` can use and leaves nothing half-written (exit 128 + signum)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__()
        self.signum = signum


def interrupt_exit_code(interrupt: BaseException) -> int:
    """The shell's code for a process stopped by a signal: 130 for Ctrl-C (SIGINT), 143 for SIGTERM."""
    return 128 + int(getattr(interrupt, "signum", signal.SIGINT))


class InterruptedRunError(QuantkitError):
    """An interrupted run that kept its work for `--resume` (finished layers, a training checkpoint): the message
    says where; exit 130 for Ctrl-C, 143 for SIGTERM, as any interrupt."""

    exit_code = 130

    def __init__(self, message: str, interrupt: BaseException | None = None) -> None:
        super().__init__(message)
        if interrupt is not None:
            self.exit_code = interrupt_exit_code(interrupt)
