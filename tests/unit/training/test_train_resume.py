"""What a resumed run takes from its checkpoint (the QAT recipe, the step), what an output_dir must hold before a
new run starts in it, and a model.config too large to train refused before it is built."""

import json

import pytest
import torch

from quantkit.errors import UsageError
from quantkit.export import metadata
from quantkit.quant import registry
from quantkit.training import checkpoint, qat
from quantkit.training import config as train_config
from quantkit.training import loop


def trained(name: str):
    return qat.training_recipe(registry.resolve(name))


def record(folder, step: int, recipe=None):
    """A checkpoint's quantkit.json as `loop.model_info` writes it."""
    folder.mkdir(parents=True)
    info = {"step": step, "train_config": {"qat_recipe": recipe and recipe.name}}
    if recipe is not None:
        info["qat"] = {"recipe": recipe.to_dict(), "scheme": recipe.scheme.describe()}
    metadata.write(folder, info)
    torch.save({"step": step}, folder / checkpoint.STATE_FILE)
    return folder


@pytest.mark.parametrize("name", ["int4-weight-only", "int8-dynamic-act-int4-weight", "gguf-q4-k-m", "quarot-w4a8-fp8"])
def test_the_recorded_recipe_reads_back_as_trained(name):
    recipe = trained(name)
    assert qat.recorded_recipe(json.loads(json.dumps({"qat": {"recipe": recipe.to_dict()}}))) == recipe
    assert qat.recorded_recipe({"step": 3}) is None


def test_a_resumed_run_keeps_the_checkpoints_recipe(tmp_path):
    recipe = trained("int4-weight-only")
    assert qat.resumed_recipe(None, recipe, tmp_path) == recipe
    assert qat.resumed_recipe(trained("int4-weight-only"), recipe, tmp_path) == recipe
    assert qat.resumed_recipe(None, None, tmp_path) is None
    with pytest.raises(UsageError, match="--qat-recipe int8-weight-only: the checkpoint .* was trained with --qat-recipe "
                                         "int4-weight-only; resume without --qat-recipe"):
        qat.resumed_recipe(trained("int8-weight-only"), recipe, tmp_path)
    with pytest.raises(UsageError, match="was trained without QAT; resume without --qat-recipe"):
        qat.resumed_recipe(recipe, None, tmp_path)


def config(tmp_path, **train):
    return train_config.from_dict({"model": {"path": "m"}, "data": {"train": "t.txt"}, "output_dir": str(tmp_path / "run"),
                                   "train": {"max_steps": 20, **train}})


def test_resumed_takes_the_recipe_and_says_so(tmp_path):
    folder = record(tmp_path / "run" / "checkpoints" / "step-000010", 10, trained("int4-weight-only"))
    said = []
    cfg, recipe = loop.resumed(config(tmp_path), None, folder, said.append)
    assert cfg.qat_recipe == "int4-weight-only" and recipe == trained("int4-weight-only")
    assert len(said) == 1 and "--qat-recipe int4-weight-only" in said[0]


def test_max_steps_below_the_checkpoint_is_refused(tmp_path):
    folder = record(tmp_path / "run" / "checkpoints" / "step-000020", 20)
    with pytest.raises(UsageError, match="--max-steps 15 is below the checkpoint's step 20"):
        loop.resumed(config(tmp_path, max_steps=15), None, folder, print)
    assert loop.resumed(config(tmp_path, max_steps=20), None, folder, print)[0].train.max_steps == 20


def test_an_output_dir_holding_only_a_config_takes_a_new_run(tmp_path):
    cfg = config(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    assert loop.prepare_output(cfg, None, overwrite=False) is None
    (run / "log.jsonl").write_text("{}\n")
    with pytest.raises(UsageError, match="holds no checkpoint to resume; pass --overwrite") as caught:
        loop.prepare_output(cfg, None, overwrite=False)
    assert "--resume" not in str(caught.value)
    record(run / "checkpoints" / "step-000010", 10)
    with pytest.raises(UsageError, match=r"already holds a run \(checkpoint step-000010\); pass --resume latest"):
        loop.prepare_output(cfg, None, overwrite=False)


def test_an_output_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "run").write_text("text")
    with pytest.raises(UsageError, match="output_dir .*run is a file; pass a directory"):
        loop.prepare_output(config(tmp_path), None, overwrite=False)


def test_a_model_config_too_large_for_ram_is_refused_before_it_is_built(monkeypatch):
    from quantkit.runtime import memory

    defaults = train_config.model_config(train_config.ModelSection(config={"model_type": "llama"}, tokenizer="t"))
    count = loop.parameter_count(defaults)  # transformers' default Llama: 6.7 B
    assert 6.5e9 < count < 7e9
    monkeypatch.setattr(memory, "physical_bytes", lambda: 64 << 30)
    with pytest.raises(UsageError, match=r"model of 6\.\d\d B parameters, which needs about 100 GiB of RAM to train here "
                                         r"\(this machine has 64 GiB\); set its sizes in model.config"):
        loop.check_fits(count, torch.device("cpu"))
    loop.check_fits(count, torch.device("cuda"))  # 4 bytes a parameter in RAM: the rest is on the GPU


@pytest.mark.parametrize("inside", ["model.path", "model.tokenizer", "data.train"])
def test_overwrite_never_deletes_the_runs_own_inputs(tmp_path, inside):
    """--overwrite empties output_dir: a model, tokenizer or data file in there is refused, and stays."""
    run = tmp_path / "run"
    held = run / "base"
    held.mkdir(parents=True)
    (held / "config.json").write_text("{}")
    cfg = config(tmp_path)
    section, field = inside.split(".")
    setattr(getattr(cfg, section), field, str(held if field != "train" else held / "config.json"))
    with pytest.raises(UsageError, match=rf"--overwrite would delete {inside} .*: it is in output_dir"):
        loop.prepare_output(cfg, None, overwrite=True)
    assert (held / "config.json").is_file()
    setattr(getattr(cfg, section), field, str(tmp_path / "elsewhere"))
    assert loop.prepare_output(cfg, None, overwrite=True) is None


def test_resume_latest_without_a_checkpoint_says_what_would_start_over(tmp_path):
    (tmp_path / "final").mkdir()
    with pytest.raises(UsageError, match=r"the run finished without checkpoints: its model is .*final\); start without "
                                         r"--resume, with --overwrite"):
        checkpoint.resolve_resume(tmp_path, "latest")
