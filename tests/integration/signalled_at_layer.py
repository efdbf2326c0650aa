"""Run `quantkit` with one process sent a signal (QUANTKIT_TEST_SIGNAL, default SIGKILL) right after it saved
layer QUANTKIT_TEST_KILL_LAYER, on rank QUANTKIT_TEST_KILL_RANK (default 0): the crash or Ctrl-C a resumed run
must recover from, at a layer the test chooses (for the resume tests)."""

import os
import signal
import sys

from quantkit.cli.console import quiet_libraries

quiet_libraries()  # as the CLI does before torch loads

from quantkit.calibration import resume  # noqa: E402

original = resume.Resumable.save_layer


def save_then_signal(self, index, *args, **kwargs):
    original(self, index, *args, **kwargs)
    if index == int(os.environ["QUANTKIT_TEST_KILL_LAYER"]) and self.rank == int(os.environ.get("QUANTKIT_TEST_KILL_RANK", 0)):
        os.kill(os.getpid(), getattr(signal, os.environ.get("QUANTKIT_TEST_SIGNAL", "SIGKILL")))


resume.Resumable.save_layer = save_then_signal

from quantkit.cli.main import main  # noqa: E402

sys.argv = ["quantkit", *sys.argv[1:]]
main()
