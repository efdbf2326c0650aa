"""Fingerprint the artifacts `quantkit finalize` makes, to prove a refactor changed no output byte.

    python scripts/artifact_digests.py MODEL --calib-data valid.txt --out before.json
    ... change the code ...
    python scripts/artifact_digests.py MODEL --calib-data valid.txt --out after.json --compare before.json

Runs `quantkit finalize` once per recipe (every shipped recipe by default; `--nproc 2` adds a two-process run
of each calibrated one) into a scratch directory, then records, per safetensors file, the sha256 of every
tensor's dtype, shape and bytes and of the header's metadata with sorted keys (the torchao format writes that
metadata in a different key order on every run), and the sha256 of config.json's `quantization_config`.
quantkit.json is left out: it holds a timestamp and the source path. A GGUF file (the GGUF recipes write one, named
RECIPE.gguf): the sha256 of every tensor's name, type, shape and bytes, and of every metadata field but quantkit's
record (`quantkit.*`, which holds the same timestamp and path).
`--compare` prints each artifact that differs and exits 1 if any does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import subprocess
import sys
import tempfile
from pathlib import Path


def safetensors_digest(file: Path) -> str:
    """The file's content, independent of the order its header lists things in."""
    data = file.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header, body = json.loads(data[8 : 8 + size]), data[8 + size :]
    digest = hashlib.sha256(json.dumps(header.pop("__metadata__", None), sort_keys=True).encode())
    for name in sorted(header):
        begin, end = header[name]["data_offsets"]
        digest.update(f"{name}:{header[name]['dtype']}:{header[name]['shape']}".encode())
        digest.update(body[begin:end])
    return digest.hexdigest()


def gguf_digest(file: Path) -> dict[str, str]:
    from gguf import GGUFReader

    reader = GGUFReader(file)
    tensors = hashlib.sha256()
    for tensor in sorted(reader.tensors, key=lambda t: t.name):
        tensors.update(f"{tensor.name}:{tensor.tensor_type.name}:{list(tensor.shape)}".encode())
        tensors.update(tensor.data.tobytes())
    fields = hashlib.sha256()
    for name in sorted(reader.fields):
        if not name.startswith("quantkit."):
            fields.update(name.encode())
            fields.update(b"".join(part.tobytes() for part in reader.fields[name].parts))
    return {"tensors": tensors.hexdigest(), "metadata": fields.hexdigest()}


def digest(artifact: Path) -> dict[str, str]:
    if artifact.suffix == ".gguf":
        return gguf_digest(artifact)
    found = {}
    for file in sorted(artifact.glob("*.safetensors")):
        found[file.name] = safetensors_digest(file)
    config = json.loads((artifact / "config.json").read_text()).get("quantization_config")
    found["quantization_config"] = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return found


def recipes(names: list[str] | None) -> list[tuple[str, bool, str]]:
    """(name, needs calibration, DST suffix) for the requested recipes, or every shipped one."""
    from quantkit.quant import registry

    def suffix(recipe) -> str:
        return ".gguf" if recipe.format.value == "gguf" else ""

    return [(name, (r := registry.resolve(name)).needs_calibration, suffix(r)) for name in names or registry.recipe_names()]


def finalize(model: Path, dst: Path, recipe: str, calibrated: bool, args: argparse.Namespace, nproc: int) -> str | None:
    cmd = [sys.executable, "-m", "quantkit.cli.main", "finalize", str(model), str(dst), "-q", recipe, "--quiet",
           "--threads", "1", "--nproc-per-node", str(nproc)]
    if calibrated:
        cmd += ["--calib-data", str(args.calib_data), "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    return None if run.returncode == 0 else (run.stderr.strip().splitlines() or ["failed"])[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--calib-data", type=Path, required=True)
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--recipes", nargs="+", help="default: every shipped recipe")
    parser.add_argument("--nproc", type=int, default=1, help="also run each calibrated recipe on this many processes")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--compare", type=Path, help="a previous --out file: report every difference")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="quantkit-digests-") as scratch:
        for recipe, calibrated, suffix in recipes(args.recipes):
            for nproc in sorted({1, args.nproc} if calibrated else {1}):
                key = f"{recipe}@{nproc}"
                dst = Path(scratch) / f"{key}{suffix}"
                error = finalize(args.model, dst, recipe, calibrated, args, nproc)
                results[key] = {"error": error} if error else digest(dst)
                print(f"{key}: {'FAILED ' + error if error else 'ok'}", flush=True)
    args.out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    if args.compare:
        before = json.loads(args.compare.read_text())
        differ = sorted(k for k in set(before) | set(results) if before.get(k) != results.get(k))
        for key in differ:
            print(f"DIFFERS: {key}")
        print(f"{len(results) - len(differ)} of {len(set(before) | set(results))} artifacts identical")
        sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
