"""A cProfile of one quantkit command, for finding where a run's time goes (on a GPU machine too).

    python scripts/profile_cli.py OUT.prof finalize SRC DST -q gptq-w4a16 --calib-data data.txt --device cuda
    python -c "import pstats; pstats.Stats('OUT.prof').sort_stats('cumulative').print_stats(60)"

The command runs in this process as `quantkit ...` does (`quantkit.cli.main.main`), without the CLI's final
`os._exit`, so that the profile is written. CUDA runs asynchronously: a kernel's time shows up wherever the host
next waits for it (`.item()`, `.to("cpu")`, a synchronize).
"""

from __future__ import annotations

import cProfile
import sys
import time


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out, args = sys.argv[1], sys.argv[2:]
    sys.argv = ["quantkit", *args]
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    code = 0
    try:
        from quantkit.cli.main import main as quantkit_main

        quantkit_main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    finally:
        profile.disable()
        profile.dump_stats(out)
        print(f"profiled {time.perf_counter() - started:.1f} s -> {out}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
