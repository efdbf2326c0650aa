"""The dry run of a GGUF K recipe plans as the run does: on rows that are not whole 256-weight super-blocks, the
time is measured on llama.cpp's fallbacks (Q4_0, Q5_0, Q8_0 blocks of 32) that the run writes, and the output
estimate is the written file's size."""

import pytest

pytest.importorskip("gguf")

from quantkit.export import gguf  # noqa: E402
from quantkit.finalization import preflight  # noqa: E402
from quantkit.finalization.finalize import CalibrationOptions, dry_run, finalize, prepare  # noqa: E402
from quantkit.quant import registry  # noqa: E402


def _recipe(name: str, convert: bool):
    recipe = registry.resolve(name)
    return gguf.qat_recipe(recipe) if convert else recipe  # a QAT model's convert step rounds to nearest


@pytest.mark.parametrize("name, convert", [("gguf-q4-k-m", False), ("gguf-q2-k", False), ("gguf-q5-k-m", False),
                                           ("gguf-q4-k-m", True)])
def test_a_k_mixture_on_rows_of_128_is_timed_and_sized_as_the_run_writes_it(wide_model_dir, text_file, tmp_path,
                                                                             name, convert):
    recipe = _recipe(name, convert)
    options = CalibrationOptions(data=str(text_file), num_samples=4, seq_len=32) if recipe.needs_calibration else None
    out = tmp_path / "model.gguf"
    report = dry_run(wide_model_dir, recipe, None, options, 1, dst=out)["preflight"]
    assert report["time"]["one_layer_seconds"] > 0 and report["time"]["layers"] == 2
    finalize(wide_model_dir, out, recipe, threads=1, calibration=options)
    assert abs(report["output_bytes"] / out.stat().st_size - 1) <= 0.1, (report["output_bytes"], out.stat().st_size)


def test_the_timed_layer_takes_the_runs_plan_with_its_own_shapes(wide_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    plan = prepare(wide_model_dir, registry.resolve("gguf-q4-k-m")).plan
    config = LlamaConfig.from_pretrained(wide_model_dir, num_hidden_layers=1, vocab_size=256)
    torch.manual_seed(0)
    timed = preflight.one_layer_plan(plan, AutoModelForCausalLM.from_config(config))
    run = {entry.name: entry for entry in plan}
    assert [e.name for e in timed] == [n for n in run if ".layers.0." in n] + ["lm_head"]
    for entry in timed[:-1]:
        assert entry == run[entry.name]  # the run's scheme: Q5_0 / Q8_0 blocks of 32 where 128 inputs are no K block
        assert (entry.scheme.weights.k_quant_type is None) == (entry.in_features == 128)
    assert timed[-1].out_features == 256 and timed[-1].scheme == run["lm_head"].scheme
