"""Training on a tiny Llama: the loss falls, resume equals an uninterrupted run, 1 rank equals 2 ranks,
and a QAT run finalizes into an artifact whose weights are exactly the fake-quantized ones it trained with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from quantkit.quant import registry
from quantkit.training import config as train_config
from quantkit.training.loop import train

from conftest import HUB_COMMIT, hub_snapshot, make_text, quantkit_offline

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    from quantkit.models.tiny import train_tokenizer

    root = tmp_path_factory.mktemp("train")
    train_tokenizer(make_text(3000), 384).save_pretrained(root / "tok")
    (root / "train.txt").write_text(make_text(6000, seed=5))
    (root / "eval.txt").write_text(make_text(800, seed=6))
    return root


def config_dict(root: Path, out: str, **train) -> dict:
    return {
        "model": {"config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384,
                             "max_position_embeddings": 128},
                  "tokenizer": str(root / "tok")},
        "data": {"train": str(root / "train.txt"), "eval": str(root / "eval.txt"), "seq_len": 32},
        "train": {"micro_batch_size": 4, "global_batch_size": 8, "max_steps": 6, "lr": 3e-3, "warmup_steps": 2,
                  "log_interval": 1, **train},
        "output_dir": str(root / out),
    }


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]


def test_loss_falls_and_run_is_recorded(workspace):
    result = train(train_config.from_dict(config_dict(workspace, "falls", max_steps=25, log_interval=5)))
    curve = losses(result.output_dir)
    assert curve[-1] < curve[0] - 0.5, curve
    assert result.eval_perplexity is not None and result.final_dir.name == "final"
    assert (result.output_dir / "config.json").is_file()
    info = json.loads((result.final_dir / "quantkit.json").read_text())
    assert "qat" not in info and info["step"] == 25


def test_resume_equals_uninterrupted(workspace):
    whole = train(train_config.from_dict(config_dict(workspace, "whole", save_interval=3)))
    assert sorted(p.name for p in (whole.output_dir / "checkpoints").iterdir()) == ["step-000003", "step-000006"]
    resumed_cfg = train_config.from_dict(config_dict(workspace, "resumed", save_interval=3))
    resumed = train(resumed_cfg, resume=str(whole.output_dir / "checkpoints" / "step-000003"))
    assert resumed.steps == 6 and losses(resumed.output_dir)[0] == pytest.approx(losses(whole.output_dir)[3], rel=1e-5)
    a, b = weights(whole.final_dir), weights(resumed.final_dir)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5, msg=name)


def test_existing_run_is_not_overwritten_silently(workspace):
    cfg = train_config.from_dict(config_dict(workspace, "twice", max_steps=1))
    train(cfg)
    from quantkit.errors import UsageError

    with pytest.raises(UsageError, match="holds no checkpoint to resume; pass --overwrite") as refused:
        train(cfg)
    assert "--resume" not in str(refused.value)  # there is nothing to resume
    train(cfg, overwrite=True)


def test_resume_latest_continues_to_a_longer_run(workspace):
    first = train(train_config.from_dict(config_dict(workspace, "longer", max_steps=2, save_interval=1)))
    more = train(train_config.from_dict(config_dict(workspace, "longer", max_steps=4, save_interval=1)), resume="latest")
    assert more.steps == 4 and [r["step"] for r in map(json.loads, (first.output_dir / "log.jsonl").read_text().splitlines())
                                if "loss" in r][-2:] == [3, 4]


def test_a_qat_run_resumed_without_its_recipe_equals_an_uninterrupted_one(workspace):
    """--qat-recipe left out on resume: QAT goes on under the checkpoint's recipe (said in one line), the final model
    is recorded as QAT and its weights are the uninterrupted run's; another recipe is refused."""
    qat_dict = {**config_dict(workspace, "qat-whole", save_interval=3), "qat_recipe": "int4-weight-only"}
    whole = train(train_config.from_dict(qat_dict))
    checkpoint = whole.output_dir / "checkpoints" / "step-000003"
    said = []
    resumed = train(train_config.from_dict(config_dict(workspace, "qat-resumed", save_interval=3)),
                    resume=str(checkpoint), note=said.append)
    assert len(said) == 1 and "--qat-recipe int4-weight-only" in said[0] and resumed.qat_recipe == "int4-weight-only"
    info = json.loads((resumed.final_dir / "quantkit.json").read_text())
    assert info["qat"]["recipe"]["name"] == info["train_config"]["qat_recipe"] == "int4-weight-only"
    a, b = weights(whole.final_dir), weights(resumed.final_dir)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5, msg=name)
    from quantkit.errors import UsageError

    other = {**config_dict(workspace, "qat-other"), "qat_recipe": "int8-weight-only"}
    with pytest.raises(UsageError, match="was trained with --qat-recipe int4-weight-only"):
        train(train_config.from_dict(other), resume=str(checkpoint))
    assert not (workspace / "qat-other").exists()


def test_resumed_at_max_steps_trains_nothing_and_says_so(workspace):
    """--max-steps equal to the checkpoint's step: no NaN loss, no throughput; the final model is the checkpoint's
    weights at its step. Below it: refused, nothing written."""
    from quantkit.errors import UsageError

    first = train(train_config.from_dict(config_dict(workspace, "at-max", max_steps=2, save_interval=2)))
    again = train(train_config.from_dict(config_dict(workspace, "at-max", max_steps=2)), resume="latest")
    assert (again.steps, again.start_step, again.final_loss, again.tokens_per_second) == (2, 2, None, None)
    assert json.loads((again.final_dir / "quantkit.json").read_text())["step"] == 2
    checkpoint = first.output_dir / "checkpoints" / "step-000002"
    for name, tensor in weights(checkpoint).items():
        torch.testing.assert_close(weights(again.final_dir)[name], tensor, atol=0, rtol=0, msg=name)
    log = (first.output_dir / "log.jsonl").read_text()
    with pytest.raises(UsageError, match="--max-steps 1 is below the checkpoint's step 2"):
        train(train_config.from_dict(config_dict(workspace, "at-max", max_steps=1)), resume="latest")
    assert (first.output_dir / "log.jsonl").read_text() == log


@pytest.mark.parametrize("name, data, message", [
    ("long-blocks", {"seq_len": 4096}, "fewer than"),
    ("no-train-file", {"train": "missing.txt"}, "does not exist"),
    ("no-text-field", {"train": "content.jsonl"}, "set data.text_field"),
    ("empty-eval", {"eval": "empty.txt"}, "has no text"),
])
def test_refused_inputs_leave_no_output_dir(workspace, name, data, message):
    """A run refused for its data writes nothing: the corrected config then starts in the same output_dir."""
    from quantkit.errors import UsageError

    (workspace / "empty.txt").write_text("")
    (workspace / "content.jsonl").write_text(json.dumps({"content": make_text(600)}) + "\n")
    base = config_dict(workspace, f"refused-{name}", max_steps=1)
    paths = {k: str(workspace / v) if k in ("train", "eval") else v for k, v in data.items()}
    with pytest.raises(UsageError, match=message):
        train(train_config.from_dict({**base, "data": {**base["data"], **paths}}))
    assert not Path(base["output_dir"]).exists()
    assert train(train_config.from_dict(base)).steps == 1


def test_train_data_takes_a_datasets_spec_and_its_train_split(workspace, tmp_path):
    """data.train as a datasets spec (a local dataset directory: the loader hub names go through); without a split
    it reads "train", where eval and calibration default to "test". data.eval keeps "test"."""
    from quantkit.data import tokenize
    from quantkit.models.loading import load_tokenizer
    from quantkit.training.loop import load_blocks

    root = tmp_path / "my-dataset"
    root.mkdir()
    train_text = make_text(400, seed=7)
    (root / "train.jsonl").write_text(json.dumps({"text": train_text}) + "\n")
    (root / "test.jsonl").write_text(json.dumps({"text": "held out"}) + "\n")
    cfg = train_config.from_dict({**config_dict(workspace, "ds"), "data": {"train": str(root), "eval": str(root), "seq_len": 32}})
    tokenizer = load_tokenizer(workspace / "tok")
    blocks, eval_ids = load_blocks(cfg, tokenizer)
    assert len(blocks) > 1 and blocks.flatten().tolist() == tokenize(tokenizer, [train_text])[: blocks.numel()].tolist()
    assert tokenizer.decode(eval_ids) == "held out"


def _cli_train(cfg_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    return subprocess.run([sys.executable, "-m", "quantkit.cli.main", "train", str(cfg_path), "--quiet", *args],
                          capture_output=True, text=True, timeout=600, env=env)


def test_one_rank_equals_two_ranks(workspace):
    """Same seed, same global batch (accumulation 2 x 1 rank vs 1 x 2 ranks, gloo): same curve, same weights."""
    results = {}
    for n in (1, 2):
        cfg_path = workspace / f"ddp{n}.yaml"
        cfg_path.write_text(yaml.safe_dump(config_dict(workspace, f"ddp{n}", max_steps=4)))
        done = _cli_train(cfg_path, "--nproc-per-node", str(n))
        assert done.returncode == 0, done.stderr[-2000:]
        results[n] = workspace / f"ddp{n}"
        info = json.loads((results[n] / "final" / "quantkit.json").read_text())
        assert (info["world_size"], info["accumulation_steps"]) == (n, 2 // n)
    assert losses(results[1]) == pytest.approx(losses(results[2]), rel=1e-4)
    one, two = weights(results[1] / "final"), weights(results[2] / "final")
    for name in one:
        torch.testing.assert_close(one[name], two[name], atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("recipe", ["int8-dynamic-act-int4-weight", "int4-weight-only", "int2-weight-only", "nvfp4-a16",
                                    "quarot-w4a8-fp8"])  # trained rotated; finalize does not rotate again
def test_qat_train_finalize_reload(workspace, recipe, tmp_path):
    """The artifact's dequantized weights equal the fake-quantized weights the model trained with (a float32 model
    trains FP4 on the bfloat16 grid of the artifact it becomes)."""
    from quantkit.finalization.finalize import finalize
    from quantkit.models.loading import load_model
    from quantkit.quant.plan import plan_model
    from quantkit.quant import fake_quant

    rec = registry.resolve(recipe)
    result = train(train_config.from_dict({**config_dict(workspace, f"qat-{recipe}", max_steps=3), "qat_recipe": recipe}))
    assert json.loads((result.final_dir / "quantkit.json").read_text())["qat"]["recipe"]["name"] == recipe

    trained = load_model(result.final_dir, dtype="float32")  # float weights; prepare as in training
    fake_quant.prepare(trained, plan_model(trained, rec))
    seen = fake_quant.fake_quantized_weights(trained)

    artifact = finalize(result.final_dir, tmp_path / "artifact", rec).dst
    script = Path(__file__).with_name("reload_plain.py")
    ids = tmp_path / "ids.safetensors"
    from safetensors.torch import save_file

    save_file({"input_ids": torch.randint(3, 300, (1, 16))}, ids)
    subprocess.run([sys.executable, str(script), str(ids), str(tmp_path), str(artifact)], check=True)
    reloaded = load_file(tmp_path / "artifact.safetensors")
    assert seen
    for name, weight in seen.items():
        torch.testing.assert_close(reloaded[name], weight.float(), atol=0, rtol=0, msg=name)
    info = json.loads((artifact / "quantkit.json").read_text())
    assert info["source"]["qat_recipe"] == recipe
    assert "transforms" not in info  # QAT trained the rotated model: finalize did not rotate it again


def _gguf_tensors(path: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """name -> (GGML type, float32 values) of every tensor in a GGUF file, as gguf's reader decodes them."""
    import gguf
    import numpy as np

    found = {}
    for tensor in gguf.GGUFReader(path).tensors:
        values = np.ascontiguousarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
        found[tensor.name] = (tensor.tensor_type.name, torch.from_numpy(values).float())
    return found


def _as_llama_cpp(weights: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Module name -> weight, renamed and row-ordered as llama.cpp holds them."""
    import gguf

    from quantkit.export.gguf import permute_rows

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    found = {}
    for name, weight in weights.items():
        head_count = heads.get(name.rsplit(".", 1)[-1])
        found[names.get_name(f"{name}.weight", try_suffixes=(".weight",))] = \
            permute_rows(weight, head_count) if head_count else weight
    return found


@pytest.mark.parametrize("recipe, types", [
    ("gguf-q4-k-m", {"output.weight": "Q6_K", "blk.0.attn_q.weight": "Q4_K", "blk.1.attn_v.weight": "Q6_K",
                     "blk.0.ffn_down.weight": "Q5_0", "blk.1.ffn_down.weight": "Q8_0", "token_embd.weight": "Q4_K"}),
    ("gguf-q4-0", {"blk.0.attn_q.weight": "Q4_0", "blk.0.ffn_down.weight": "Q4_0", "output.weight": "F32"}),
    ("my-q4.yaml", {"blk.0.attn_q.weight": "Q4_0", "blk.0.ffn_down.weight": "Q4_0", "output.weight": "F32"}),
])
def test_qat_train_finalize_gguf(workspace, recipe, types, tmp_path):
    """`train --qat-recipe R` then `finalize -q R` to .gguf, no calibration data: every quantized tensor in the file
    dequantizes to the weight the trained model computes with under its fake quantizers (K grids: llama.cpp's search
    on the trained weights), bit for bit, the token embedding of a mixture too (trained on its K grid). A K mixture (calibrated by GPTQ after a plain model) is converted by rounding on the grids it trained on.
    A user's recipe file whose scales are in the model's dtype (GGUF stores fp16 ones: both commands quantize on
    those) is finalized under its own name, not refused as another recipe."""
    import gguf

    from quantkit.finalization.finalize import finalize
    from quantkit.models.loading import load_model
    from quantkit.grids.k_grids import quantize_k
    from quantkit.quant import fake_quant
    from quantkit.training import qat

    if recipe.endswith(".yaml"):  # Q4_0's grid, the scales left in the model's dtype
        (tmp_path / recipe).write_text("scheme: {weights: {dtype: int4, granularity: group, group_size: 32}}\n"
                                       "format: gguf\non_indivisible: skip\n")
        recipe = str(tmp_path / recipe)
    k_model = {"hidden_size": 256, "intermediate_size": 352}  # q/k/v/o, gate/up: whole K super-blocks; down: falls back
    config = config_dict(workspace, f"qat-{Path(recipe).stem}", max_steps=3)
    config["model"]["config"].update(k_model)
    result = train(train_config.from_dict({**config, "qat_recipe": recipe}))
    trained_recipe = json.loads((result.final_dir / "quantkit.json").read_text())["qat"]["recipe"]
    assert (trained_recipe["name"], trained_recipe["steps"][0]["name"]) == (Path(recipe).stem, "rtn")

    trained = load_model(result.final_dir, dtype="float32").eval()
    embedding = trained.get_input_embeddings().weight.detach().clone()
    fake_quant.prepare(trained, qat.plan(trained, registry.resolve(recipe)), qat.embedding(trained, registry.resolve(recipe)))
    seen = _as_llama_cpp(fake_quant.fake_quantized_weights(trained), trained.config)
    assert ("token_embd.weight" in seen) == ("token_embd.weight" in types)

    out = finalize(result.final_dir, tmp_path / "qat.gguf", registry.resolve(recipe))
    assert out.calibration is None and out.recipe.steps[0].name == "rtn"
    written = _gguf_tensors(out.dst)
    assert {name: written[name][0] for name in types} == types
    assert len(seen) >= 14
    for name, weight in seen.items():
        torch.testing.assert_close(written[name][1].reshape(weight.shape), weight, atol=0, rtol=0, msg=name)
    if "token_embd.weight" in types:  # a mixture's: on its base type
        expected = quantize_k(embedding, gguf.GGMLQuantizationType[types["token_embd.weight"]]).dequantize()
        torch.testing.assert_close(written["token_embd.weight"][1].reshape(expected.shape), expected, atol=0, rtol=0)


TAGGED = "1" * 40  # org/tiny's commit at tag v1


@pytest.fixture(scope="module")
def hub_home(workspace, tiny_model_dir, tmp_path_factory) -> Path:
    """HF_HOME with org/tiny cached at main and at tag v1 (two snapshots of the tiny Llama), and org/tok: a
    tokenizer alone (no config, no weights)."""
    import shutil

    home = tmp_path_factory.mktemp("hf-home")
    for commit, ref in ((HUB_COMMIT, "main"), (TAGGED, "v1")):
        shutil.copytree(tiny_model_dir, hub_snapshot(home, "org/tiny", commit, ref), dirs_exist_ok=True)
    shutil.copytree(workspace / "tok", hub_snapshot(home, "org/tok"), dirs_exist_ok=True)
    return home


def _snapshot(home: Path, repo: str, commit: str) -> str:
    return str(home / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / commit)


def _hub_config(workspace: Path, tmp_path: Path, model: dict) -> Path:
    cfg = {"model": model, "data": {"train": str(workspace / "train.txt"), "seq_len": 32}, "output_dir": str(tmp_path / "run"),
           "train": {"micro_batch_size": 4, "global_batch_size": 4, "max_steps": 2, "warmup_steps": 1}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_train_fine_tunes_hub_ids_from_the_cache(workspace, hub_home, tmp_path, monkeypatch):
    """model.path and model.tokenizer as hub ids, offline: model.revision picks the snapshot; the run records
    the directories it read and keeps the ids in its config. In this process (a fresh one costs 8 s of imports):
    huggingface_hub reads HF_HOME at import, so its cache and offline switch are set where it reads them."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model = {"path": "org/tiny", "revision": "v1", "tokenizer": "org/tok"}
    train(train_config.load(_hub_config(workspace, tmp_path, model)))
    info = json.loads((tmp_path / "run" / "final" / "quantkit.json").read_text())
    assert info["sources"] == {"model": _snapshot(hub_home, "org/tiny", TAGGED), "tokenizer": _snapshot(hub_home, "org/tok", HUB_COMMIT)}
    assert info["train_config"]["model"] | model == info["train_config"]["model"] and info["step"] == 2


def test_the_tokenizer_defaults_to_the_models_snapshot(hub_home):
    code = ("from quantkit.training import config as t; "
            "s = t.resolve_sources(t.from_dict({'model': {'path': 'org/tiny'}, 'data': {'train': 'x.txt'}})); "
            "print(s.model, s.tokenizer, 'torch' in __import__('sys').modules)")
    env = {**os.environ, "HF_HOME": str(hub_home), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    main = _snapshot(hub_home, "org/tiny", HUB_COMMIT)
    assert done.stdout.split() == [main, main, "False"], done.stderr[-2000:]  # resolved before torch loads


@pytest.mark.parametrize("model, message", [
    ({"path": "org/absent"}, "model.path: org/absent is neither a directory nor a model in the Hugging Face cache"),
    ({"path": "org/tiny", "revision": "v9"}, "model.path: org/tiny at revision v9 is neither a directory nor a model"),
    ({"path": "org/tiny", "tokenizer": "org/absent"}, "model.tokenizer: org/absent is neither a directory nor a tokenizer"),
])
def test_a_hub_id_missing_from_the_cache_is_a_one_line_usage_error(workspace, hub_home, tmp_path, model, message):
    done = quantkit_offline(hub_home, "train", str(_hub_config(workspace, tmp_path, model)))
    assert done.returncode == 2 and message in done.stderr and "hf download" in done.stderr, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()
