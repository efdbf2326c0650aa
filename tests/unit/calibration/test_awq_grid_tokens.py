"""AWQ's grid scored on part of the calibration tokens (`grid_tokens`): the same share of every batch's rows."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from quantkit.algorithms.arguments import AWQArgs
from quantkit.calibration import calibrate
from quantkit.calibration.steps.awq import scored_rows
from quantkit.quant.schemes import SchemeError
from quantkit.models.loading import decoder_layers
from quantkit.quant.plan import plan_model
from quantkit.quant.registry import resolve


def test_every_batch_gives_the_same_share_of_its_rows():
    shapes = [torch.Size([4, 16, 64])] * 3  # 192 tokens
    assert scored_rows(shapes, 96, None) == [2, 2, 2]
    assert scored_rows(shapes + [torch.Size([1, 16, 64])], 10, None) == [1, 1, 1, 1]  # at least a row a batch
    assert scored_rows(shapes, 192, None) is None and scored_rows(shapes, None, None) is None  # every row


def test_grid_tokens_must_be_positive_or_null():
    assert AWQArgs(grid_tokens=None).grid_tokens is None
    with pytest.raises(SchemeError, match="grid_tokens"):
        AWQArgs(grid_tokens=0)


def _model():
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(config).eval()


def _awq(tmp_path, grid_tokens) -> tuple[dict, list[int]]:
    path = tmp_path / f"awq-{grid_tokens}.yaml"
    path.write_text("scheme: {weights: {dtype: int4, granularity: group, group_size: 32, symmetric: true}}\n"
                    f"algorithm: [{{name: awq, grid_tokens: {'null' if grid_tokens is None else grid_tokens}}}, {{name: rtn}}]\n"
                    "format: compressed-tensors\n")
    recipe = resolve(str(path))
    model = _model()
    rows: list[int] = []  # the batch sizes the first layer's attention block was run on
    attention = decoder_layers(model)[0].self_attn
    handle = attention.register_forward_pre_hook(lambda m, a, k: rows.append(k["hidden_states"].shape[0]), with_kwargs=True)
    samples = torch.randint(0, 300, (8, 16), generator=torch.Generator().manual_seed(0))
    result = calibrate(model, plan_model(model, recipe), recipe, samples, torch.device("cpu"), batch_size=4)
    handle.remove()
    return result.qweights, rows


def test_the_grid_runs_on_fewer_rows_and_every_token_is_scored_without_a_limit(tmp_path):
    every, every_rows = _awq(tmp_path, None)
    same, same_rows = _awq(tmp_path, 128)  # all 128 tokens: no limit in effect
    part, part_rows = _awq(tmp_path, 32)  # a quarter: one row of each 4-row batch
    assert set(every_rows) == {4} and same_rows == every_rows
    assert 1 in part_rows and 4 in part_rows  # the grid on one row, the statistics' pass on the whole batch
    for name, q in every.items():
        assert torch.equal(q.qdata, same[name].qdata), name
    assert part.keys() == every.keys()
