"""Time quantkit's MLX export against mlx-lm's own: round to nearest, 4-bit affine groups of 64.

    python scripts/build_large_checkpoint.py --shape llama-3.1-8b --layers 4          # prints the checkpoint's path
    python scripts/bench_mlx_export.py CHECKPOINT [--threads 2] [--runs 1] [--json mlx-export.json]

`quantkit finalize CHECKPOINT OUT -q mlx-4bit-g64 --format mlx` (streamed from the shards, one decoder layer in
memory) against `mlx_lm.convert --hf-path CHECKPOINT --mlx-path OUT -q --q-bits 4 --q-group-size 64` (MLX_PYTHON's
mlx-lm, ~/.cache/quantkit/mlx-venv as `make test-mlx` builds it; never imported here), in turns (quantkit, mlx-lm,
quantkit, ...), each with OMP_NUM_THREADS = `--threads`. A row per run: wall and CPU seconds, peak RSS, the
directory's weight bytes and the load average when it ended (the machine is shared: quote CPU seconds beside the
wall). Both write the token embedding quantized and lm_head quantized, the norms in the checkpoint's dtype. Each
output is removed once measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from datetime import date
from pathlib import Path

import harness

MLX_PYTHON = Path(os.environ.get("MLX_PYTHON", Path.home() / ".cache" / "quantkit" / "mlx-venv" / "bin" / "python"))


def commands(src: Path, out: Path, threads: int) -> dict[str, list[str]]:
    return {
        "quantkit": harness.finalize_command(src, out / "quantkit", "mlx-4bit-g64", threads, "--format", "mlx"),
        "mlx-lm": [str(MLX_PYTHON), "-m", "mlx_lm", "convert", "--hf-path", str(src), "--mlx-path", str(out / "mlx-lm"),
                   "-q", "--q-bits", "4", "--q-group-size", "64"],
    }


def measure(tool: str, cmd: list[str], out: Path, threads: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    run = harness.measure(cmd, harness.thread_env(threads))
    size = sum(f.stat().st_size for f in out.glob("*.safetensors")) if out.is_dir() else None
    row = {"tool": tool, "seconds": run.seconds, "cpu_seconds": run.cpu_seconds, "peak_rss_mib": run.peak_rss_mib,
           "size": size, "load": os.getloadavg()[0], "error": run.stderr_tail.strip()[-300:] if run.returncode else ""}
    print(f"{tool}: {run.seconds:.1f} s, {run.cpu_seconds:.1f} CPU s, {run.peak_rss_mib:.0f} MiB, load {row['load']:.1f}"
          + (f", FAILED: {row['error']}" if run.returncode else ""), file=sys.stderr)
    shutil.rmtree(out, ignore_errors=True)
    return row


def table(rows: list[dict]) -> str:
    cells = [[r["tool"], f"{r['seconds']:.1f}", f"{r['cpu_seconds']:.1f}", f"{r['peak_rss_mib']:.0f}",
              harness.fmt(r["size"] and r["size"] / harness.MIB, ".1f"), f"{r['load']:.1f}", r["error"]] for r in rows]
    return harness.markdown_table(["tool", "wall s", "CPU s", "peak RSS MiB", "weights MiB", "load", "error"], cells,
                                  "lrrrrrl")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=1, help="runs of each tool, in turns")
    p.add_argument("--workdir", type=Path, help="where the outputs go (default: a temporary directory beside the checkpoint)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.workdir or args.checkpoint.parent) as tmp:
        for _ in range(args.runs):
            for tool, cmd in commands(args.checkpoint, Path(tmp), args.threads).items():
                rows.append(measure(tool, cmd, Path(tmp) / tool, args.threads))
    print(f"\n{date.today().isoformat()}, {harness.host_facts()['platform']}, {args.threads} threads; "
          f"{args.checkpoint} ({harness.parameter_count(args.checkpoint):,} parameters)\n")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
