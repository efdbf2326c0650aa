"""The bad-input catalogue, through the real CLI: each case exits non-zero with one line on stderr, no traceback,
nothing at DST or beside it, and nothing run from the user's files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import make_text

pytestmark = pytest.mark.integration

QUANTKIT = [sys.executable, "-m", "quantkit.cli.main"]


@pytest.fixture(scope="module")
def sources(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """Broken variants of the tiny model, a calibration text, recipe and train-config files."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("bad")

    def variant(name: str) -> Path:
        return Path(shutil.copytree(tiny_model_dir, root / name))

    found = {"model": tiny_model_dir, "empty-dir": root / "empty-dir", "afile": root / "afile"}
    found["empty-dir"].mkdir()
    found["afile"].write_text("x")
    truncated = variant("truncated") / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:5000])
    found["truncated"] = truncated.parent
    (variant("bad-config") / "config.json").write_text("{")
    found["bad-config"] = root / "bad-config"
    custom = variant("custom-code")
    config = json.loads((custom / "config.json").read_text())
    config.update(model_type="evil-model", auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"})
    (custom / "config.json").write_text(json.dumps(config))
    (custom / "evil.py").write_text(f"open({str(root / 'PWNED')!r}, 'w').write('ran')\n")
    found["custom-code"], found["pwned"] = custom, root / "PWNED"
    quantized = variant("quantized")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors"}
    (quantized / "config.json").write_text(json.dumps(config))
    found["quantized"] = quantized
    nan = variant("nan")
    tensors = load_file(nan / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(tensors, nan / "model.safetensors", metadata={"format": "pt"})
    found["nan"] = nan
    compiled = variant("compiled")  # saved from a torch.compile'd model: every name under `_orig_mod.`
    tensors = load_file(compiled / "model.safetensors")
    save_file({f"_orig_mod.{k}": v for k, v in tensors.items()}, compiled / "model.safetensors", metadata={"format": "pt"})
    found["compiled"] = compiled
    found["short"] = root / "short.txt"
    found["short"].write_text("a few words only\n")
    found["binary"] = root / "binary.txt"
    found["binary"].write_bytes(os.urandom(20_000))  # random bytes named .txt
    found["empty"] = root / "empty.txt"
    found["empty"].write_text("")
    found["evil-recipe"] = root / "evil.yaml"
    found["evil-recipe"].write_text(f"scheme: !!python/object/apply:os.system ['touch {root / 'PWNED'}']\nformat: torchao\n")
    found["bad-recipe"] = root / "bad.yaml"
    found["bad-recipe"].write_text("scheme: {weights: {dtype: int16, granularity: channel}}\nformat: compressed-tensors\n")
    found["evil-config"] = root / "train.yaml"
    found["evil-config"].write_text(f"model: !!python/object/apply:os.system ['touch {root / 'PWNED'}']\n")
    found["typo-config"] = root / "typo.yaml"
    found["typo-config"].write_text(f"model: {{path: {tiny_model_dir}}}\ndata: {{train: x.txt}}\ntrian: {{max_steps: 1}}\n")
    found["vocab-config"] = root / "vocab.yaml"  # a tokenizer larger than model.config's vocab_size
    (root / "train.txt").write_text(make_text(2000, seed=3))
    found["vocab-config"].write_text(yaml.safe_dump({
        "model": {"config": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                             "num_attention_heads": 2, "vocab_size": 64}, "tokenizer": str(tiny_model_dir)},
        "data": {"train": str(root / "train.txt"), "seq_len": 32}, "train": {"max_steps": 1},
        "output_dir": str(root / "vocab-run")}))
    found["positions-config"] = root / "positions.yaml"  # blocks longer than the model's positions
    found["positions-config"].write_text(yaml.safe_dump({
        "model": {"config": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                             "num_attention_heads": 2, "vocab_size": 4096, "max_position_embeddings": 16},
                  "tokenizer": str(tiny_model_dir)},
        "data": {"train": str(root / "train.txt"), "seq_len": 32}, "train": {"max_steps": 1},
        "output_dir": str(root / "positions-run")}))
    return found


CASES = {
    "unknown recipe": (["finalize", "{model}", "{dst}", "-q", "int4-weight-onyl"], 2, "did you mean"),
    "malformed recipe field": (["finalize", "{model}", "{dst}", "-q", "{bad-recipe}"], 2, "scheme.weights.dtype"),
    "recipe with a python tag": (["finalize", "{model}", "{dst}", "-q", "{evil-recipe}"], 2, "not valid YAML"),
    "missing SRC": (["finalize", "{dst}-missing", "{dst}", "-q", "int4-weight-only"], 2, "does not exist"),
    "empty SRC dir": (["finalize", "{empty-dir}", "{dst}", "-q", "int4-weight-only"], 2, "has no config.json"),
    "truncated weights": (["finalize", "{truncated}", "{dst}", "-q", "int4-weight-only"], 2, "is truncated"),
    "invalid config.json": (["finalize", "{bad-config}", "{dst}", "-q", "int4-weight-only"], 2, "not valid JSON"),
    "custom code without the flag": (["finalize", "{custom-code}", "{dst}", "-q", "int4-weight-only"], 2,
                                     "pass --trust-remote-code to run it, if you trust it"),
    "already quantized SRC": (["finalize", "{quantized}", "{dst}", "-q", "int4-weight-only"], 2, "already quantized"),
    "DST under a file": (["finalize", "{model}", "{afile}/out", "-q", "int4-weight-only"], 2, "is a file"),
    "missing calibration file": (["finalize", "{model}", "{dst}", "-q", "gptq-w4a16", "--calib-data", "{dst}.txt"], 2, "does not exist"),
    "empty calibration file": (["finalize", "{model}", "{dst}", "-q", "gptq-w4a16", "--calib-data", "{empty}"], 2, "has no text"),
    "calibration file too short": (["finalize", "{model}", "{dst}", "-q", "gptq-w4a16", "--calib-data", "{short}",
                                    "--num-samples", "4", "--seq-len", "32"], 2, "tokens; --num-samples 4 x --seq-len 32 needs"),
    "calibration file too short, dry run": (["finalize", "{model}", "{dst}", "-q", "gptq-w4a16", "--calib-data", "{short}",
                                            "--num-samples", "4", "--seq-len", "32", "--dry-run"], 2,
                                           "tokens; --num-samples 4 x --seq-len 32 needs"),
    "calibration data that is not text": (["finalize", "{model}", "{dst}", "-q", "gptq-w4a16", "--calib-data", "{binary}"], 2,
                                          "binary.txt is not text"),
    "calibration data that is not text, dry run": (["finalize", "{model}", "{dst}", "-q", "gptq-w4a16", "--calib-data",
                                                    "{binary}", "--dry-run"], 2, "binary.txt is not text"),
    "--seq-len beyond the model's positions": (["finalize", "{model}", "{dst}", "-q", "gptq-w4a16", "--calib-data", "{short}",
                                                "--seq-len", "100000"], 2,
                                               "--seq-len 100000 is longer than the 512 positions of"),
    "--seq-len beyond the model's positions, dry run": (["finalize", "{model}", "{dst}", "-q", "gptq-w4a16", "--calib-data",
                                                         "{short}", "--seq-len", "100000", "--dry-run"], 2,
                                                        "pass --seq-len 512 or less"),
    "eval data that is not text": (["eval", "{model}", "--data", "{binary}"], 2, "binary.txt is not text"),
    "eval -q calibration data that is not text": (["eval", "{model}", "--data", "{short}", "-q", "gptq-w4a16", "--calib-data",
                                                   "{binary}"], 2, "binary.txt is not text"),
    "--num-samples 0": (["finalize", "{model}", "{dst}", "-q", "gptq-w4a16", "--num-samples", "0"], 2, "--num-samples"),
    "--num-samples -1": (["finalize", "{model}", "{dst}", "-q", "gptq-w4a16", "--num-samples", "-1"], 2, "--num-samples"),
    "--seq-len 0": (["finalize", "{model}", "{dst}", "-q", "gptq-w4a16", "--seq-len", "0"], 2, "--seq-len"),
    "--nproc-per-node 0": (["finalize", "{model}", "{dst}", "-q", "gptq-w4a16", "--nproc-per-node", "0"], 2, "--nproc-per-node"),
    "weights under other names": (["finalize", "{compiled}", "{dst}", "-q", "int4-weight-only"], 2,
                                  "without the prefix '_orig_mod.'"),
    "weights under other names, eval": (["eval", "{compiled}", "--data", "{short}"], 2, "lacks"),
    "--json into a missing directory": (["finalize", "{model}", "{dst}", "-q", "int4-weight-only", "--json",
                                         "{dst}-missing/r.json"], 2, "does not exist; create it or give another path"),
    "existing DST, dry run": (["finalize", "{model}", "{afile}", "-q", "int4-weight-only", "--dry-run"], 2,
                              "already exists; pass --overwrite"),
    "NaN weights": (["finalize", "{nan}", "{dst}", "-q", "int4-weight-only"], 2, "non-finite values"),
    "bad shard size": (["finalize", "{model}", "{dst}", "-q", "int4-weight-only", "--max-shard-size", "huge"], 2, "5GB"),
    "--resume without an interrupted run": (["finalize", "{model}", "{dst}", "-q", "gptq-w4a16", "--calib-data", "{short}",
                                             "--resume"], 2, "no interrupted run"),
    "--tensor-type without a type": (["finalize", "{model}", "{dst}.gguf", "-q", "gguf-q4-0", "--tensor-type", "ffn_down"], 2,
                                     "is not REGEX=TYPE"),
    "--tensor-type of an unknown type": (["finalize", "{model}", "{dst}.gguf", "-q", "gguf-q4-0", "--tensor-type",
                                          "ffn_down=q4_k_m"], 2, "is neither a GGML type"),
    "--tensor-type outside GGUF": (["finalize", "{model}", "{dst}", "-q", "int4-weight-only", "--tensor-type",
                                    "down_proj=q8_0"], 2, "use --format gguf"),
    "train config with a python tag": (["train", "{evil-config}"], 2, "not valid YAML"),
    "mistyped train config key": (["train", "{typo-config}"], 2, "trian"),
    "tokenizer larger than the model's vocabulary": (["train", "{vocab-config}"], 2, "set model.config's vocab_size to at least"),
    "train blocks beyond the model's positions": (["train", "{positions-config}"], 2, "data.seq_len 32 is beyond the model's 16 positions"),
}
if not torch.cuda.is_available():
    CASES["--device cuda without a GPU"] = (["finalize", "{model}", "{dst}", "-q", "gptq-w4a16", "--calib-data", "{short}",
                                             "--device", "cuda"], 2, "no CUDA GPU")


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_leaves_nothing(sources, tmp_path, case):
    args, code, message = CASES[case]
    values = {**{k: str(v) for k, v in sources.items()}, "dst": str(tmp_path / "out")}
    env = {k: v for k, v in os.environ.items() if k != "QUANTKIT_DEBUG"}
    done = subprocess.run([*QUANTKIT, *[a.format(**values) for a in args]], capture_output=True, text=True,
                          timeout=300, env=env)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == code, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    assert [p.name for p in tmp_path.iterdir()] == []  # no DST, no temporary directory beside it
    assert not sources["pwned"].exists()  # nothing from the user's files ran


DISK_RUNNER = str(Path(__file__).with_name("disk_full.py"))


@pytest.mark.parametrize("disk,message", [("small", "free; free some space or choose another DST"),
                                          ("full", "no space left on the device while writing")])
def test_a_full_disk_is_one_line_and_leaves_nothing(sources, tmp_path, disk, message):
    """Too little free space is refused before loading (the preflight's output size); a disk that fills up
    while writing (ENOSPC, simulated) leaves no DST and no temporary directory."""
    env = {**{k: v for k, v in os.environ.items() if k != "QUANTKIT_DEBUG"}, "QUANTKIT_TEST_DISK": disk}
    done = subprocess.run([sys.executable, DISK_RUNNER, "finalize", str(sources["model"]), str(tmp_path / "out"),
                           "-q", "int4-weight-only", "--quiet"], capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == (2 if disk == "small" else 1), done.stderr
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], done.stderr
    assert [p.name for p in tmp_path.iterdir()] == []


def test_sigkill_of_one_rank_stops_every_rank_and_leaves_no_dst_or_process(sources, tmp_path):
    """Rank 1 killed with SIGKILL once it finished its first layer: the launcher exits non-zero in one line within
    the collective timeout, no DST, and no rank is left running."""
    runner = str(Path(__file__).with_name("signalled_at_layer.py"))
    env = {**{k: v for k, v in os.environ.items() if k not in ("QUANTKIT_DEBUG", "RANK", "WORLD_SIZE", "LOCAL_RANK")},
           "QUANTKIT_TEST_KILL_LAYER": "0", "QUANTKIT_TEST_KILL_RANK": "1", "QUANTKIT_DIST_TIMEOUT": "60"}
    marker = f"quantkit-sigkill-{tmp_path.name}"
    calib = tmp_path.parent / f"{tmp_path.name}-calib.txt"
    calib.write_text(make_text(2000, seed=4))
    args = ["finalize", str(sources["model"]), str(tmp_path / "out"), "-q", "gptq-w4a16", "--calib-data", str(calib),
            "--num-samples", "4", "--seq-len", "16", "--threads", "1", "--quiet", "--json", str(tmp_path / marker)]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           f"--log-dir={tmp_path / 'torchrun-logs'}", runner, *args],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode != 0
    assert not (tmp_path / "out").exists()
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"orphan ranks: {left.stdout}"


@pytest.mark.parametrize("dst", [".", ".."])
def test_overwrite_never_deletes_the_source_model(sources, tmp_path, dst):
    """DST that is SRC, or holds it, with --overwrite: refused in one line, the source model untouched."""
    src = Path(shutil.copytree(sources["model"], tmp_path / "models" / "src"))
    before = sorted(p.name for p in src.iterdir())
    done = subprocess.run([*QUANTKIT, "finalize", str(src), str(src / dst), "-q", "int4-weight-only", "--overwrite"],
                          capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "QUANTKIT_DEBUG"})
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "the source model" in lines[0] and "choose another path" in lines[0]
    assert sorted(p.name for p in src.iterdir()) == before
    assert sorted(p.name for p in src.parent.iterdir()) == ["src"]
