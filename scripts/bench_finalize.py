"""Benchmark `quantkit finalize` against a plain transformers load + save of the same model.

Run from the repository root (with the venv active):

    python scripts/bench_finalize.py --repeats 3
    python scripts/bench_finalize.py --formats all --json bench.json --threads 2

What it measures, for every recipe (in its default format, or with `--formats all` in every format that
runs on this machine and can express the recipe):

* wall time of `quantkit finalize SRC DST -q RECIPE --format FMT --threads T --quiet --overwrite`, run as a
  subprocess, end to end (interpreter start, imports, load, quantize, compress, save);
* wall time of a baseline subprocess that does `AutoModelForCausalLM.from_pretrained(SRC, dtype="auto")`
  then `save_pretrained(DST)` plus the tokenizer (this script's `--baseline-load-save SRC DST` sub-mode);
* the two are interleaved (baseline, finalize, baseline, finalize, ...) and the ratio finalize / baseline
  is taken pair by pair, so slow drift of a noisy machine cancels; the table shows medians;
* peak RSS of each finalize subprocess (`os.wait4` rusage, ru_maxrss), in MiB and as a multiple of the
  source model's size on disk (the sum of its *.safetensors files);
* the artifact's size on disk and the compression (source bytes / output bytes).

The source model (~70M parameters: a 4-layer Llama, hidden 1024, intermediate 2816, 16 query and 16
key/value heads by default, a byte-level BPE tokenizer of up to 8192 tokens trained on `--text`) is built
once with `quantkit.models.tiny.build_tiny_llama` (scripts/harness.py) and cached under `--workdir`. Both
subprocesses get the same thread count: OMP_NUM_THREADS/MKL_NUM_THREADS in their environment, `--threads` for
quantkit and `torch.set_num_threads` in the baseline.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import harness
from harness import MIB, Run, median

DEFAULT_TEXT = harness.WIKITEXT / "valid.txt"


@dataclass
class Result:
    """Every measurement of one recipe x format, with its paired baselines."""

    recipe: str
    format: str
    finalize: list[Run] = field(default_factory=list)
    baseline: list[Run] = field(default_factory=list)
    output_bytes: int = 0


# ---------------------------------------------------------------- baseline sub-mode


def baseline_load_save(src: str, dst: str, threads: int) -> None:
    """The baseline: what plain transformers costs to read the model and write it back."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    shutil.rmtree(dst, ignore_errors=True)  # as `quantkit finalize --overwrite` does
    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)


# ---------------------------------------------------------------- jobs and commands


def jobs(formats: str) -> list[tuple[str, str]]:
    """(recipe, format) pairs: each recipe's default format, or every format that runs here and fits."""
    from quantkit.export import exporter
    from quantkit.quant.registry import Format, recipe_names, resolve
    from quantkit.runtime.hardware import missing_requirement

    pairs = []
    for name in recipe_names():
        recipe = resolve(name)
        candidates = list(Format) if formats == "all" else [recipe.format]
        for fmt in candidates:
            if missing_requirement(recipe, fmt) is None and exporter(fmt).unsupported(recipe) is None:
                pairs.append((name, fmt.value))
    return pairs


def finalize_cmd(src: Path, dst: Path, recipe: str, fmt: str, threads: int) -> list[str]:
    return harness.finalize_command(src, dst, recipe, threads, "--format", fmt)


def baseline_cmd(src: Path, dst: Path, threads: int) -> list[str]:
    script = str(Path(__file__).resolve())
    return [sys.executable, script, "--baseline-load-save", str(src), str(dst), "--threads", str(threads)]


# ---------------------------------------------------------------- measuring


def bench(src: Path, out: Path, pairs: list[tuple[str, str]], repeats: int, threads: int) -> list[Result]:
    """Rounds of (baseline, finalize) pairs for every job; each finalize has its own adjacent baseline."""
    env = harness.thread_env(threads)
    results = [Result(recipe, fmt) for recipe, fmt in pairs]
    for round_no in range(1, repeats + 1):
        for result in results:
            dst = out / f"{result.recipe}.{result.format}"
            result.baseline.append(harness.measure(baseline_cmd(src, out / "baseline", threads), env))
            run = harness.measure(finalize_cmd(src, dst, result.recipe, result.format, threads), env)
            result.finalize.append(run)
            result.output_bytes = harness.safetensors_bytes(dst) if run.returncode == 0 else 0
            print(f"round {round_no}/{repeats} {result.recipe} [{result.format}]: finalize {run.seconds:.2f}s "
                  f"(rc {run.returncode}), load+save {result.baseline[-1].seconds:.2f}s", file=sys.stderr)
    return results


def warm_up(src: Path, out: Path, threads: int) -> None:
    """One untimed baseline: the page cache holds the source and bytecode caches exist before timing."""
    run = harness.measure(baseline_cmd(src, out / "baseline", threads), harness.thread_env(threads))
    if run.returncode:
        sys.exit(f"baseline load+save failed:\n{run.stderr_tail}")


# ---------------------------------------------------------------- reporting


def summary(result: Result, source_bytes: int) -> dict:
    """The medians of one job (None where finalize failed)."""
    ok = [(f, b) for f, b in zip(result.finalize, result.baseline) if f.returncode == 0]
    if not ok:
        return {"failed": True, "error": result.finalize[-1].stderr_tail}
    peak_mib = max(f.peak_rss_kib for f, _ in ok) / 1024
    return {
        "failed": False,
        "finalize_s": median([f.seconds for f, _ in ok]),
        "baseline_s": median([b.seconds for _, b in ok]),
        "ratio": median([f.seconds / b.seconds for f, b in ok]),
        "finalize_cpu_s": median([f.cpu_seconds for f, _ in ok]),
        "peak_rss_mib": peak_mib,
        "baseline_peak_rss_mib": max(b.peak_rss_kib for _, b in ok) / 1024,
        "rss_over_model": peak_mib * MIB / source_bytes,
        "output_mib": result.output_bytes / MIB,
        "compression": source_bytes / result.output_bytes if result.output_bytes else None,
    }


TABLE_HEADER = ["recipe", "format", "finalize s (median)", "load+save s (median)", "ratio (median of pairs)",
                "peak RSS MiB", "RSS / model size", "output size MiB", "compression"]


def table_row(result: Result, source_bytes: int) -> list[str]:
    s = summary(result, source_bytes)
    if s["failed"]:
        return [result.recipe, result.format, "FAILED"] + [""] * 6
    return [result.recipe, result.format, f"{s['finalize_s']:.2f}", f"{s['baseline_s']:.2f}", f"{s['ratio']:.2f}x",
            f"{s['peak_rss_mib']:.0f}", f"{s['rss_over_model']:.1f}x", f"{s['output_mib']:.1f}",
            f"{s['compression']:.2f}x"]


def table(results: list[Result], source_bytes: int) -> str:
    return harness.markdown_table(TABLE_HEADER, [table_row(result, source_bytes) for result in results])


def machine_facts(src: Path, threads: int, repeats: int) -> dict:
    source_bytes = harness.safetensors_bytes(src)
    return {
        **harness.host_facts(), **harness.versions("torch", "transformers", "torchao", "compressed-tensors"),
        "threads": threads, "repeats": repeats,
        "model": str(src), "parameters": harness.parameter_count(src), "model_bytes": source_bytes,
        "config": json.loads((src / "config.json").read_text()),
    }


def print_report(facts: dict, results: list[Result]) -> None:
    cfg = facts["config"]
    print(f"- python {facts['python']} on {facts['platform']}, {facts['cpus']} CPUs, threads {facts['threads']}, "
          f"repeats {facts['repeats']}")
    print(f"- torch {facts['torch']}, transformers {facts['transformers']}, torchao {facts['torchao']}, "
          f"compressed-tensors {facts['compressed-tensors']}")
    print(f"- model: {facts['parameters']:,} parameters ({facts['parameters'] / 1e6:.1f}M), "
          f"{facts['model_bytes'] / MIB:.1f} MiB of safetensors, dtype {cfg.get('dtype') or cfg.get('torch_dtype')}, "
          f"vocab {cfg['vocab_size']}, kv heads {cfg['num_key_value_heads']}")
    print()
    print(table(results, facts["model_bytes"]))


def write_json(path: Path, facts: dict, results: list[Result]) -> None:
    payload = {
        "machine": facts,
        "results": [{**asdict(r), "summary": summary(r, facts["model_bytes"])} for r in results],
    }
    path.write_text(json.dumps(payload, indent=2))


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/quantkit-bench"))
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="tokenizer training text")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--kv-heads", type=int, default=16, help="num_key_value_heads (16: no GQA, 4: GQA)")
    p.add_argument("--formats", choices=["default", "all"], default="default")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, help="also write every measurement here")
    p.add_argument("--baseline-load-save", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.baseline_load_save:
        return baseline_load_save(*args.baseline_load_save, args.threads)
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = harness.llama_70m(args.workdir, args.text, args.dtype, args.kv_heads)
    out = args.workdir / "out"
    out.mkdir(exist_ok=True)
    warm_up(src, out, args.threads)
    results = bench(src, out, jobs(args.formats), args.repeats, args.threads)
    facts = machine_facts(src, args.threads, args.repeats)
    print_report(facts, results)
    if args.json:
        write_json(args.json, facts, results)


if __name__ == "__main__":
    main()
