import pytest

from quantkit.schemes import ActivationSpec, Granularity, QDtype, QuantScheme, SchemeError, WeightSpec


def test_group_needs_group_size():
    with pytest.raises(SchemeError, match="group_size"):
        WeightSpec(QDtype.INT4, Granularity.GROUP)


def test_channel_refuses_group_size():
    with pytest.raises(SchemeError, match="group_size"):
        WeightSpec(QDtype.INT8, Granularity.CHANNEL, group_size=32)


def test_float8_weights_are_symmetric_per_channel():
    with pytest.raises(SchemeError, match="float8"):
        WeightSpec(QDtype.FLOAT8, Granularity.GROUP, group_size=32)
    with pytest.raises(SchemeError, match="float8"):
        WeightSpec(QDtype.FLOAT8, Granularity.CHANNEL, symmetric=False)


def test_activations_are_per_token_int8_or_float8():
    for dtype in (QDtype.INT2, QDtype.INT3, QDtype.INT4):
        with pytest.raises(SchemeError, match="activations.dtype"):
            ActivationSpec(dtype)
    with pytest.raises(SchemeError, match="activations.granularity"):
        ActivationSpec(QDtype.INT8, granularity=Granularity.CHANNEL)


def test_with_group_size_changes_only_the_group_size():
    scheme = QuantScheme(WeightSpec(QDtype.INT4, Granularity.GROUP, 128), ActivationSpec(QDtype.INT8, symmetric=False))
    smaller = scheme.with_group_size(64)
    assert smaller.weights.group_size == 64 and smaller.activations == scheme.activations
    assert scheme.weights.group_size == 128


def test_qranges():
    assert QDtype.INT2.qrange == (-2, 1) and QDtype.INT3.qrange == (-4, 3) and QDtype.INT4.qrange == (-8, 7) and QDtype.INT8.qrange == (-128, 127)
    assert QDtype.FLOAT8.qrange == (-448.0, 448.0)
    assert [d.bits for d in QDtype] == [2, 3, 4, 8, 8]
