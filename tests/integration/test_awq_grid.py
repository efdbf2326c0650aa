"""AWQ's shipped grid against the one it passed over, on a small model trained here.

`awq-w4a16` is symmetric and `awq-w4a16-asym` (LLM Compressor's AWQ default, int8 zero points) is one flag away.
The numbers do not pick a side by much: on the trained hidden-512 benchmark model the symmetric grid measured
+0.00% perplexity against the asymmetric one's +0.02% (README, "Today's schemes"); on this test's model the
asymmetric grid is 0.11% better. What decides the default is that an asymmetric pack-quantized artifact does not
load in plain transformers 5.x (packed zero points, llm-compressor #1618), which every quantkit artifact must.
This test holds that choice to a price: the symmetric default may cost at most 0.25% perplexity against the
asymmetric grid; a change that makes it cost more fails here, and the default is then to be chosen again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import make_text
from quantkit.evaluation.evaluate import perplexity
from quantkit.finalization.finalize import CalibrationOptions, prepare, quantize_model
from quantkit.models.loading import load_tokenizer
from quantkit.quant import registry
from quantkit.training import config as train_config
from quantkit.training.loop import train

pytestmark = pytest.mark.integration

PRICE = 0.0025  # the perplexity the symmetric default may cost against the asymmetric grid (measured: 0.11%)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    from quantkit.models.tiny import train_tokenizer

    root = tmp_path_factory.mktemp("awq-grid")
    train_tokenizer(make_text(3000), 384).save_pretrained(root / "tok")
    (root / "train.txt").write_text(make_text(12000, seed=5))
    (root / "eval.txt").write_text(make_text(3000, seed=6))
    config = {
        "model": {"config": {"model_type": "llama", "hidden_size": 128, "intermediate_size": 384,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "vocab_size": 384, "max_position_embeddings": 128},
                  "tokenizer": str(root / "tok")},
        "data": {"train": str(root / "train.txt"), "seq_len": 64},
        "train": {"micro_batch_size": 8, "global_batch_size": 8, "max_steps": 60, "lr": 3e-3, "warmup_steps": 5,
                  "log_interval": 20},
        "output_dir": str(root / "run"),
    }
    return train(train_config.from_dict(config)).final_dir, root


def test_the_symmetric_awq_default_costs_little_against_the_asymmetric_grid(trained):
    model_dir, root = trained
    tokenizer = load_tokenizer(model_dir)
    ids = torch.tensor(tokenizer((root / "eval.txt").read_text())["input_ids"])
    options = CalibrationOptions(data=str(root / "train.txt"), num_samples=16, seq_len=64)
    ppl = {}
    for name in ("awq-w4a16", "awq-w4a16-asym"):
        recipe = registry.resolve(name)
        model = quantize_model(prepare(model_dir, recipe), recipe, calibration=options)
        ppl[name] = perplexity(model, ids, seq_len=64).perplexity
    assert registry.resolve("awq-w4a16").scheme.weights.symmetric
    assert all(torch.isfinite(torch.tensor(value)) for value in ppl.values()), ppl
    assert ppl["awq-w4a16"] <= ppl["awq-w4a16-asym"] * (1 + PRICE), ppl
