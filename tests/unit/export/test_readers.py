"""The reading side of the format plug-ins: each format's reader detects its artifacts from what they say of themselves
(torch-free), `export.reader_for` is the one lookup, and the modules that load or run artifacts for `eval` name no
format (checked by reading their code)."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from quantkit.export import FORMATS, made_as, not_sharded, reader_for, reader_named, readers
from quantkit.quant.registry import Format

ROOT = Path(__file__).resolve().parents[3]


def _artifact(src: Path, dst: Path, quant_method: str | None = None, made_in: str | None = None) -> Path:
    """The tiny model's directory as an artifact says what it is: config.json's quantization_config (what transformers
    and LLM Compressor write) and / or quantkit.json's format (what `finalize` writes)."""
    shutil.copytree(src, dst)
    if quant_method:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = {"quant_method": quant_method}
        (dst / "config.json").write_text(json.dumps(config))
    if made_in:
        (dst / "quantkit.json").write_text(json.dumps({"format": made_in, "recipe": {"name": "r"}}))
    return dst


@pytest.fixture(scope="module")
def artifacts(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("artifacts")
    gguf = root / "model-Q8_0.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    renamed = root / "model.bin"  # a GGUF file named otherwise: its magic bytes say what it is
    renamed.write_bytes(b"GGUF" + bytes(60))
    return {
        "plain": tiny_model_dir,
        "compressed-tensors": _artifact(tiny_model_dir, root / "ct", "compressed-tensors", "compressed-tensors"),
        "llm-compressor": _artifact(tiny_model_dir, root / "llmc", "compressed-tensors"),  # no quantkit.json
        "torchao": _artifact(tiny_model_dir, root / "torchao", "torchao", "torchao"),
        "torchao, quantkit.json alone": _artifact(tiny_model_dir, root / "torchao-made", made_in="torchao"),
        "gptq": _artifact(tiny_model_dir, root / "gptq", "gptq"),  # another tool's: plain transformers loads it
        "gguf": gguf,
        "gguf, renamed": renamed,
    }


@pytest.mark.parametrize("name, fmt", [
    ("plain", None), ("compressed-tensors", Format.COMPRESSED_TENSORS), ("llm-compressor", Format.COMPRESSED_TENSORS),
    ("torchao", Format.TORCHAO), ("torchao, quantkit.json alone", Format.TORCHAO), ("gptq", None),
    ("gguf", Format.GGUF), ("gguf, renamed", Format.GGUF),
])
def test_each_format_detects_its_own_artifacts_and_no_other(artifacts, name, fmt):
    path = artifacts[name]
    for reader in readers():
        if reader.format is not None:
            assert reader.detect(path) == (reader.format is fmt), (reader, name)
    assert reader_for(path).format is fmt
    assert reader_for(str(path)).format is fmt  # a MODEL as the CLI gets it


def test_what_does_not_exist_is_no_format_but_a_named_gguf(tmp_path):
    for missing in (tmp_path / "missing", "org/name", tmp_path):  # a hub id is resolved later, as a directory
        assert reader_for(missing).format is None
    assert reader_for(tmp_path / "missing.GGUF").format is Format.GGUF  # named so: check_gguf_file says it is missing
    text = tmp_path / "notes.txt"
    text.write_text("GGU")
    assert reader_for(text).format is None


def test_detection_reads_no_torch(artifacts):
    paths = json.dumps([str(p) for p in artifacts.values()])
    code = (f"import json, sys; from quantkit.export import reader_for; "
            f"found = [reader_for(p) for p in json.loads({paths!r})]; sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_directory_says_what_made_it(artifacts, tmp_path):
    assert made_as(artifacts["plain"]) is None and made_as(artifacts["gguf"]) is None
    assert made_as(artifacts["llm-compressor"]) == "compressed-tensors" and made_as(artifacts["gptq"]) == "gptq"
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(Exception, match=r"config\.json is not valid JSON"):
        reader_for(tmp_path)


def test_what_each_reader_declares(artifacts):
    ct, torchao, gguf = (reader_for(artifacts[n]) for n in ("compressed-tensors", "torchao", "gguf"))
    plain = reader_for(artifacts["plain"])
    assert [r.ENGINE for r in (plain, ct, torchao)] == [None, None, None]
    assert gguf.ENGINE == "quantkit.evaluation.gguf" and gguf.single_file and not ct.single_file
    assert (plain.SHARDS_WHILE_LOADING, ct.SHARDS_WHILE_LOADING) == (True, False)
    assert plain.unsharded(artifacts["plain"]) is None and ct.unsharded(artifacts["compressed-tensors"]) is None
    for name in ("torchao", "gptq"):
        path = artifacts[name]
        assert reader_for(path).unsharded(path) == not_sharded(path, name) == (
            f"{path}: {name} artifacts do not shard (their quantized tensors lack the operations transformers' tensor "
            "parallelism splits them with); evaluate it without --tp, or finalize with --format compressed-tensors")
    assert "runs in llama.cpp: evaluate it without --tp" in gguf.unsharded(artifacts["gguf"])
    assert [r.quantized(artifacts[n]) for r, n in ((plain, "plain"), (ct, "compressed-tensors"), (torchao, "torchao"),
                                                   (gguf, "gguf"), (plain, "gptq"))] == [
        None, "compressed-tensors", "torchao", "a GGUF file", "gptq"]


def test_reports_name_their_readers_and_each_says_what_the_table_notes():
    assert reader_named("gguf Q8_0").format is Format.GGUF and reader_named("gguf").format is Format.GGUF
    assert reader_named("compressed-tensors").format is Format.COMPRESSED_TENSORS
    assert reader_named(None).format is None and reader_named("gptq").format is None
    assert reader_named("gguf Q8_0").legend(["llama.cpp (x)"], True) == ".gguf files run in llama.cpp (x), without task scores (n/a)"
    assert "dequantized weights" in reader_named("compressed-tensors").legend(["transformers"], False)
    assert reader_named("torchao").legend(["transformers"], False) is None and reader_named(None).legend([], False) is None


def test_every_format_has_a_reader_module_beside_its_writer():
    for fmt, registration in FORMATS.items():
        assert registration.reader and (ROOT / "quantkit" / "export" / f"{registration.reader}.py").is_file(), fmt


# ---------------------------------------------------------------- no format named outside the registry

ENGINES = {reader.ENGINE for reader in readers() if reader.ENGINE}
# the modules that detect, load or run artifacts for `eval`, which ask `export.reader_for` (the engines it names are
# their formats' own code, with the scripts they run beside them: `<engine>_*.py`, MLX's mlx_runner.py)
READING = [path for path in (ROOT / "quantkit" / "evaluation").glob("*.py")
           if not any(f"quantkit.evaluation.{path.stem}".startswith((engine, f"{engine}_")) for engine in ENGINES)] + [ROOT / "quantkit" / "models" / "loading.py",
                                                                    ROOT / "cli" / "eval.py"]
TOKENS = sorted({token for fmt, registration in FORMATS.items()
                 for token in (fmt.value, registration.module, registration.reader)} | {"is_gguf"})


def _code_names(path: Path) -> list[str]:
    """A module's string constants (docstrings, `help=` texts and the help's EXAMPLES left out: prose and help may
    name formats), identifiers and imported module names."""
    tree = ast.parse(path.read_text())
    prose = {id(node.body[0].value) for node in ast.walk(tree)
             if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
             and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "help" or (
                isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EXAMPLES" for t in node.targets)):
            prose |= {id(n) for n in ast.walk(node.value)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            found.append(node.value)
        elif isinstance(node, ast.Attribute):
            found.append(node.attr)
        elif isinstance(node, ast.Name):
            found.append(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append(node.name)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names] + [alias.asname or "" for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found += [node.module or ""] + [alias.name for alias in node.names]
    return found


def test_the_reading_modules_name_no_format():
    assert len(READING) > 5 and ENGINES == {"quantkit.evaluation.gguf", "quantkit.evaluation.mlx"}
    offenders = {str(path.relative_to(ROOT)): hits for path in READING
                 for hits in [sorted({s for s in _code_names(path) if any(t in s.lower() for t in TOKENS)})] if hits}
    assert not offenders, f"name a format through export.reader_for, not by name: {offenders}"


def test_the_check_catches_a_format_named_again(tmp_path):
    """The check itself: the branches this registry replaced are caught."""
    for line in ('from quantkit.evaluation import gguf\nx = gguf.is_gguf("m")',
                 'if method not in (None, "compressed-tensors"):\n    pass',
                 'from quantkit.export.compressed_tensors import experts_load_problem',
                 'fmt = made.get("format") == "torchao"'):
        module = tmp_path / "m.py"
        module.write_text(line)
        assert any(any(t in s.lower() for t in TOKENS) for s in _code_names(module)), line
    module.write_text('"""A .gguf docstring."""\nx = typer.Argument(help=".gguf files run in llama.cpp")')
    assert not any(any(t in s.lower() for t in TOKENS) for s in _code_names(module))
