"""Distributed GPTQ calibration: 1 rank x 1 thread, 1 rank x 2 threads and 2 ranks x 1 thread, in one run.

    python scripts/bench_distributed.py [--repeats 2] [--model DIR | --hidden 2048 --layers 5] [--json out.json]

GPTQ W4A16 (`gptq-w4a16`) on the ~68M-parameter Llama that scripts/bench_finalize.py builds (hidden 1024,
4 layers, MLP 2816, vocab 8192; `--hidden H --layers L` builds the same shape wider or deeper: 2048 x 5 is the
~290M one; or --model DIR), with 64 x 256 calibration tokens from WikiText-2 valid.
Each configuration is a separate `quantkit finalize` process (the 2-rank one self-launches torchrun), run in
turn round after round; wall time includes imports and loading. Where the time goes comes from each run's
`quantkit.json` (rank 0's calibration phases: forward passes, Hessians with their all-reduce, GPTQ solves with
their gather) and the wall time (the rest: interpreter, imports, torchrun, reading, tokenizing, writing). Peak RSS is the largest single process of the
run (for the 2-rank run: one rank, or the launcher). The 2-rank artifact is checked against the 1-rank one.

With `--llmc-python PY` (a venv with llm-compressor, as for scripts/bench_calibration.py), llm-compressor's
oneshot GPTQModifier W4A16 runs the same three configurations right after quantkit's, in the same round, on
the same calibration token ids (quantkit's blocks, saved to a file): 1 process with 1 or 2 threads, and 2
processes under `torch.distributed.run` (its distributed oneshot: each rank gets half the samples; gloo, as its
`init_dist` needs an accelerator). Its 2-rank artifact is compared with its 1-rank one too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import harness
from harness import median

CONFIGS = {"1 rank x 1 thread": (1, 1), "1 rank x 2 threads": (1, 2), "2 ranks x 1 thread": (2, 1)}
Measured = dict[str, tuple[float, int, int, dict]]  # "tool: configuration" -> (wall s, peak RSS KiB, return code, phases)
PHASES = {"forward": "forward", "observe": "Hessians", "quantize": "GPTQ solves"}  # quantkit.json name -> table column


def command(src: Path, dst: Path, calib: Path, ranks: int, threads: int, samples: int, seq_len: int) -> list[str]:
    nproc = ["--nproc-per-node", ranks] if ranks > 1 else []
    calibration = harness.calibration_options(calib, samples, seq_len)
    return harness.finalize_command(src, dst, "gptq-w4a16", threads, *calibration, *nproc)


def llmc_command(python: Path, runner: Path, src: Path, dst: Path, ids: Path, ranks: int, threads: int) -> list[str]:
    return harness.llmc_command(python, runner, src, dst, ids, "gptq-w4a16", "default", threads, ranks)


def run_round(src: Path, work: Path, calib: Path, args, llmc: tuple[Path, Path] | None) -> Measured:
    results = {}
    tools = [("quantkit", lambda dst, r, t: command(src, dst, calib, r, t, args.samples, args.seq_len))]
    if llmc:
        runner, ids = llmc
        tools.append(("llm-compressor", lambda dst, r, t: llmc_command(args.llmc_python, runner, src, dst, ids, r, t)))
    for tool, make in tools:
        for label, (ranks, threads) in CONFIGS.items():
            env = harness.thread_env(threads, mkl=False)  # OMP_NUM_THREADS only, as this benchmark always set
            dst = work / tool / label.replace(" ", "")
            shutil.rmtree(dst, ignore_errors=True)
            shutil.rmtree(dst.with_name(dst.name + ".partial"), ignore_errors=True)  # an earlier run's, interrupted
            run = harness.measure(make(dst, ranks, threads), env)
            if run.returncode:
                sys.exit(f"{tool} {label} failed:\n{run.stderr_tail}")
            results[f"{tool}: {label}"] = (run.seconds, run.peak_rss_kib, run.returncode, phases(dst, run.seconds))
            print(f"{tool} {label}: {run.seconds:.1f} s, peak RSS {run.peak_rss_mib:.0f} MiB", file=sys.stderr)
    return results


def phases(dst: Path, wall: float) -> dict[str, float]:
    """Rank 0's calibration phases from quantkit's `quantkit.json` and the rest of the wall time; {} for a peer."""
    info = dst / "quantkit.json"
    if not info.is_file():
        return {}
    seconds = json.loads(info.read_text())["calibration"]["seconds"]
    spent = {column: seconds.get(name, 0.0) for name, column in PHASES.items()}
    return spent | {"the rest": wall - sum(seconds.values())}


def same_artifact(work: Path) -> bool:
    from safetensors.torch import load_file

    one = load_file(next((work / "1rankx1thread").glob("*.safetensors")))
    two = load_file(next((work / "2ranksx1thread").glob("*.safetensors")))
    return one.keys() == two.keys() and all((one[k] == two[k]).all() for k in one)


def prepare_llmc(src: Path, work: Path, args: argparse.Namespace) -> tuple[Path, Path] | None:
    """(runner, calibration ids) for the llm-compressor side, or None without --llmc-python."""
    if not args.llmc_python:
        return None
    work.mkdir(parents=True, exist_ok=True)
    runner = harness.write_llmc_runner(work)
    return runner, harness.write_calibration(src, args.text, args.samples, args.seq_len, work)


def table(medians: dict[str, float], rss: dict[str, float]) -> str:
    """One row a tool and configuration; the speed-up is against the same tool's 1 rank x 1 thread."""
    rows = []
    for label, seconds in medians.items():
        base = medians[label.split(":")[0] + ": 1 rank x 1 thread"]
        rows.append([label, f"{seconds:.1f}", f"{base / seconds:.2f}x", f"{rss[label]:.0f}"])
    header = ["tool: configuration", "wall s (median)", "speed-up vs its 1x1", "peak RSS MiB"]
    return harness.markdown_table(header, rows)


def phase_table(rounds: list[Measured]) -> str:
    """quantkit's phases, median over the rounds, one row a configuration."""
    rows = []
    for label in (label for label in rounds[0] if label.startswith("quantkit")):
        spent = {column: median([r[label][3][column] for r in rounds]) for column in rounds[0][label][3]}
        rows.append([label.split(": ")[1], *(f"{seconds:.1f}" for seconds in spent.values())])
    return harness.markdown_table(["configuration", *PHASES.values(), "the rest"], rows)


def report(src: Path, work: Path, rounds: list[Measured], args: argparse.Namespace) -> None:
    medians = {label: median([r[label][0] for r in rounds]) for label in rounds[0]}
    rss = {label: max(r[label][1] for r in rounds) / 1024 for label in rounds[0]}
    size = harness.safetensors_bytes(src) / 2**20
    print(f"model {src} ({size:.0f} MiB), gptq-w4a16, {args.samples} x {args.seq_len} tokens, {args.repeats} round(s)\n")
    print(table(medians, rss))
    print("\nquantkit, where the time goes (rank 0, seconds):\n")
    print(phase_table(rounds))
    ran = {label.split(":")[0] for label in rounds[0]}  # not an earlier run's directory
    identical = {tool: same_artifact(work / tool) for tool in ("quantkit", "llm-compressor") if tool in ran}
    print()
    for tool, same in identical.items():
        print(f"{tool}: 2-rank artifact bit-identical to its 1-rank x 1-thread one: {same}")
    if "llm-compressor: 2 ranks x 1 thread" in medians:
        ratio = medians["quantkit: 2 ranks x 1 thread"] / medians["llm-compressor: 2 ranks x 1 thread"]
        print(f"quantkit / llm-compressor wall time, 2 ranks x 1 thread each: {ratio:.2f}x")
    if args.json:
        spent = {label: r[label][3] for r in rounds[-1:] for label in r}
        args.json.write_text(json.dumps({"wall_s": medians, "peak_rss_mib": rss, "identical": identical, "phases_s": spent},
                                        indent=2))


def built_model(args: argparse.Namespace) -> Path:
    """The 68M Llama, or the same shape at --hidden / --layers (cached in --workdir)."""
    if (args.hidden, args.layers) == (1024, 4):
        return harness.llama_70m(args.workdir, args.text, "bfloat16", 16)
    shape = harness.llama_shape(args.hidden) | {"num_hidden_layers": args.layers}
    return harness.build_llama(args.workdir / f"llama-h{args.hidden}-l{args.layers}-bfloat16", args.text, "bfloat16",
                               generate_if_missing=True, **shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="model directory (default: build the 68M Llama)")
    parser.add_argument("--hidden", type=int, default=1024, help="the built Llama's hidden size (MLP 2.75x)")
    parser.add_argument("--layers", type=int, default=4, help="the built Llama's decoder layers")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/quantkit-bench"))
    parser.add_argument("--text", type=Path, default=harness.WIKITEXT / "valid.txt")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--llmc-python", type=Path, help="python of a venv with llmcompressor: run it side by side")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = args.model or built_model(args)
    work = args.workdir / "distributed"
    llmc = prepare_llmc(src, work, args)
    rounds = [run_round(src, work, args.text, args, llmc) for _ in range(args.repeats)]
    report(src, work, rounds, args)


if __name__ == "__main__":
    main()
