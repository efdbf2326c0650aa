"""Half-precision Linear products computed in float32 during calibration, on CPUs without native ones."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantkit.runtime import precision
@pytest.fixture
def no_native_products(monkeypatch):
    monkeypatch.setattr(precision, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))


def test_native_products_follow_the_cpu_flags():
    assert not precision.native_half_products(torch.bfloat16, {"avx2", "fma"})
    assert precision.native_half_products(torch.bfloat16, {"avx2", "avx512_bf16"})
    assert precision.native_half_products(torch.bfloat16, {"amx_bf16"})
    assert not precision.native_half_products(torch.float16, {"avx512_bf16"})
    assert precision.native_half_products(torch.float16, {"avx512_fp16"})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_linear_computes_in_float32_and_rounds_once(no_native_products, dtype):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48).to(dtype)
    x = torch.randn(4, 8, 64).to(dtype)
    expected = F.linear(x.float(), linear.weight.float(), linear.bias.float()).to(dtype)
    with precision.float32_products(dtype, torch.device("cpu")) as on:
        assert on
        got = linear(x)
    assert got.dtype == dtype and torch.equal(got, expected)
    assert linear.weight.dtype == dtype  # the weights are left as they are
    assert nn.Linear.forward is not precision._float32_forward  # and Linear is itself again after the block
    # a native half-precision GEMM also accumulates in float32 and rounds once: the same up to summation order
    torch.testing.assert_close(linear(x).float(), got.float(), atol=0.02, rtol=0.02)


def test_float32_models_and_native_cpus_are_left_alone(no_native_products, monkeypatch):
    with precision.float32_products(torch.float32, torch.device("cpu")) as on:
        assert not on and nn.Linear.forward is not precision._float32_forward
    monkeypatch.setattr(precision, "_cpu_flags", lambda: frozenset({"avx512_bf16"}))
    with precision.float32_products(torch.bfloat16, torch.device("cpu")) as on:
        assert not on


def test_tf32_products_change_nothing_off_cuda_and_put_the_setting_back():
    """TF32 is a CUDA tensor-core mode: on the CPU the block runs as it would without it; the CUDA flag is only
    set inside a CUDA block and restored after it (the GPU suite checks a CUDA block's products)."""
    from quantkit.runtime.precision import tf32_products

    before = torch.backends.cuda.matmul.allow_tf32
    a = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    with tf32_products("cpu"):
        assert torch.backends.cuda.matmul.allow_tf32 == before
        product = a @ a
    torch.testing.assert_close(product, a @ a, rtol=0, atol=0)
    try:
        with tf32_products(torch.device("cuda")):  # sets the flag without touching a GPU
            assert torch.backends.cuda.matmul.allow_tf32 is True
            raise RuntimeError("a failure inside the block")
    except RuntimeError:
        pass
    assert torch.backends.cuda.matmul.allow_tf32 == before
