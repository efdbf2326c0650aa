"""AWQ's grid scored on part of the calibration tokens (`grid_tokens`): the same share of every batch's rows."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from quantkit.algorithms.methods.awq import AWQArgs
from quantkit.calibration import calibrate
from quantkit.calibration.steps.awq import scored_rows
from quantkit.grids.schemes import SchemeError
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


def test_the_capture_keeps_only_the_scored_rows_and_sums_their_hessian():
    """With scored rows, a block run on the layer's batch keeps copies of its first rows only (not views holding the
    whole batch), a one-Linear block's Hessian sums only those rows, and the activation statistic reads every token."""
    from quantkit.calibration.hooks import capture_inputs
    from quantkit.calibration.steps.awq import capture_blocks
    from quantkit.grids.observers import ChannelAbsMean, HessianObserver

    model = _model()
    layers = decoder_layers(model)
    samples = torch.randint(0, 300, (8, 16), generator=torch.Generator().manual_seed(0))
    inputs = capture_inputs(model, layers, list(samples.split(4)), torch.device("cpu"))
    layer = layers[0]
    blocks = [(layer.mlp, layer.mlp.gate_proj), (layer.mlp.down_proj, layer.mlp.down_proj)]
    (calls, act, _, cut), (_, _, hessian, _) = capture_blocks(layer, blocks, inputs, rows=[1, 3])
    ((whole_calls, whole_act, _, whole_cut), (_, _, whole_hessian, _)) = capture_blocks(layer, blocks, inputs)
    assert cut and not whole_cut
    assert [args[0].shape[0] for args, _ in calls] == [1, 3]
    for (args, _), (whole, _) in zip(calls, whole_calls):
        assert args[0].untyped_storage().nbytes() == args[0].numel() * args[0].element_size()  # a copy
        assert torch.equal(args[0], whole[0][: args[0].shape[0]])
    assert torch.equal(act.mean(), whole_act.mean())  # every token
    expected = HessianObserver()
    for (whole, _), count in zip(whole_calls, [1, 3]):
        expected.update(layer.mlp.act_fn(layer.mlp.gate_proj(whole[0][:count])) * layer.mlp.up_proj(whole[0][:count]))
    assert hessian.state["count"].item() == expected.state["count"].item() == (1 + 3) * 16
    for got, want in zip(hessian.state["xtx"], expected.state["xtx"]):
        torch.testing.assert_close(got, want)
    assert whole_hessian.state["count"].item() == 8 * 16
    assert isinstance(act, ChannelAbsMean)
