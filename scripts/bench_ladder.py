"""llama.cpp's whole ladder: KL divergence from F16 against bits per weight, every GGUF file of a bench_gguf.py (or
bench_budget.py) work dir that llama-perplexity --kl-divergence has judged, one line per tool.

    python scripts/bench_ladder.py --svg docs/gguf-ladder.svg --md ladder.md      # after bench_gguf.py's runs

It makes nothing and measures nothing: it reads what those scripts left in `--workdir`'s model folders (each
`X.gguf` beside its `X.kld.log`, made against the folder's f16.kld on the same windows: a log older than its file or
than f16.kld is stale and left out), so every point of one model comes from the same F16 logits. Names say who
made a file: `llama-TYPE[-imatrix].gguf` (llama-quantize, with or without llama-imatrix's matrix),
`quantkit-RECIPE.gguf` (a shipped recipe, or a row spec with a modifier: `-rtn` / `-gptq` / `-rot` / `-gN`; the
chart's quantkit line takes each type's best file, the table lists them all), `quantkit-budget-B.gguf` (`--target-bpw B`), `autoround-*` / `autoscheme-*` (auto-round).
Bits per weight are the file's tensors: 8 x tensor bytes / parameters (bench_budget.py's measure; the header,
tokenizer and metadata, left out on both sides). The table lists, per model and type, every tool's file with its
size, KLD mean and 99th percentile, and the same-top share.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import harness

KLD = re.compile(r"Mean\s+KLD:\s+([0-9.]+)\s+±\s+([0-9.]+)")
P99 = re.compile(r"99\.0%\s+KLD:\s+([0-9.]+)")
SAME_TOP = re.compile(r"Same top p:\s+([0-9.]+)")
MODELS = {"plain": "llama-h512-i1536-trained200", "outlier": "llama-h512-i1536-trained200-outlier-c4-f64"}


def tool_and_type(stem: str) -> tuple[str, str] | None:
    """(tool, type or target) of a file name the bench scripts write, or None (F16, an imatrix, a variant)."""
    if found := re.fullmatch(r"llama-(.+?)(-imatrix)?", stem):
        return ("llama.cpp + imatrix" if found[2] else "llama.cpp"), found[1]
    if found := re.fullmatch(r"quantkit-budget-([0-9.]+)", stem):
        return "quantkit --target-bpw", found[1]
    if found := re.fullmatch(r"quantkit-gguf-(.+)", stem):
        spec = found[1].split("-rtn")[0].split("-gptq")[0].split("-rot")[0]
        return "quantkit", spec.upper().replace("-", "_")
    if found := re.fullmatch(r"(autoround|autoscheme)-(.+)", stem):
        return ("auto-round AutoScheme" if found[1] == "autoscheme" else "auto-round"), found[2]
    return None


def points(folder: Path, parameters: int) -> list[dict]:
    from gguf import GGUFReader

    base = folder / "f16.kld"
    found = []
    for path in sorted(folder.glob("*.gguf")):
        log, named = path.with_suffix(".kld.log"), tool_and_type(path.stem)
        if named is None or not log.is_file() or not base.is_file():
            continue
        if log.stat().st_mtime < max(path.stat().st_mtime, base.stat().st_mtime):
            continue  # stale: judged before the file or the F16 logits were made
        text = log.read_text()
        if not (kld := KLD.search(text)):
            continue
        tensor_bytes = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
        found.append({"tool": named[0], "type": named[1], "file": path.name, "bpw": 8 * tensor_bytes / parameters,
                      "mib": tensor_bytes / harness.MIB, "kld": float(kld[1]), "kld_error": float(kld[2]),
                      "p99": float(P99.search(text)[1]) if P99.search(text) else None,
                      "same_top": float(SAME_TOP.search(text)[1]) if SAME_TOP.search(text) else None})
    return found


def table(rows: dict[str, list[dict]]) -> str:
    body = []
    for model, found in rows.items():
        for r in sorted(found, key=lambda r: (r["bpw"], r["tool"])):
            body.append([model, r["type"], r["tool"], f"{r['bpw']:.3f}", f"{r['mib']:.2f}",
                         f"{r['kld']:.5f} ± {r['kld_error']:.5f}", harness.fmt(r["p99"], ".4f"),
                         harness.fmt(r["same_top"], ".2f")])
    return harness.markdown_table(["model", "type", "tool", "bits per weight", "tensors MiB", "KLD mean", "KLD p99",
                                   "same top %"], body, "lllrrrrr")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/quantkit-bench-calib/gguf"))
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--source", type=Path, default=Path("/tmp/quantkit-bench-calib"),
                   help="where the models themselves are (for their parameter counts): SOURCE/NAME/final")
    p.add_argument("--tools", nargs="+", help="only these tools' lines in the chart")
    p.add_argument("--svg", type=Path)
    p.add_argument("--md", type=Path)
    args = p.parse_args(argv)
    rows = {}
    for model in args.models:
        src = args.source / MODELS[model]
        src = src / "final" if (src / "final").is_dir() else src
        rows[model] = points(args.workdir / MODELS[model], harness.parameter_count(src))
    text = table(rows)
    print(text)
    if args.md:
        args.md.write_text(text + "\n")
    if args.svg:
        best = {}  # (model, tool, type): the file of least KLD (quantkit's recipe and its variants of one type)
        for model, found in rows.items():
            for r in found:
                key = (model, r["tool"], r["type"])
                if (not args.tools or r["tool"] in args.tools) and (key not in best or r["kld"] < best[key]["kld"]):
                    best[key] = r
        lines, labels = {}, {}
        for (model, tool, kind), r in best.items():
            name = f"{tool} ({model})"
            lines.setdefault(name, []).append((r["bpw"], r["kld"]))
            if tool == "llama.cpp + imatrix":
                labels.setdefault(name, []).append((r["bpw"], r["kld"], kind))
        harness.log_chart(lines, args.svg, "bits per weight (file tensors / parameters)", "mean KL divergence from F16",
                          dashed={n for n in lines if "(outlier)" in n}, labels=labels)


if __name__ == "__main__":
    main()
