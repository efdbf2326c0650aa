import math

import pytest
import torch

from quantkit.algorithms.hadamard import (
    UnsupportedWidthError,
    hadamard_matrix,
    hadamard_transform,
    is_supported_width,
    random_hadamard_matrix,
)

POWERS_OF_TWO = [2**k for k in range(13)]  # 1 to 4096
NOT_POWERS_OF_TWO = [12, 20, 28, 36, 40, 44, 52, 60, 100, 108, 140, 156, 172, 252,  # every odd part compressed-tensors
                     12 * 64, 20 * 64, 28 * 64, 12 * 256, 20 * 128, 172 * 16]  # stores, and some widths models use
SIZES = POWERS_OF_TWO + NOT_POWERS_OF_TWO


@pytest.mark.parametrize("n", SIZES)
def test_hadamard_matrices_are_exact_and_orthonormal(n):
    h = hadamard_matrix(n, normalize=False)
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    rows = torch.arange(n) if n <= 1024 else torch.randperm(n, generator=torch.Generator().manual_seed(0))[:128]
    assert torch.equal(h[rows] @ h.T, n * torch.eye(n, dtype=torch.float64)[rows])  # exact: integers in float64
    q = hadamard_matrix(n)
    torch.testing.assert_close(q[rows] @ q.T, torch.eye(n, dtype=torch.float64)[rows], rtol=0, atol=1e-12)


def test_every_size_up_to_256_with_a_construction_is_supported():
    supported = [n for n in range(1, 257) if is_supported_width(n)]
    assert supported == [1, 2] + list(range(4, 257, 4))  # Hadamard orders are 1, 2 and multiples of 4
    for n in supported:
        h = hadamard_matrix(n, normalize=False)
        assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64)), n


@pytest.mark.parametrize("n", [8, 64, 2048])
def test_powers_of_two_are_compressed_tensors_sylvester_matrix(n):
    from compressed_tensors.transform.utils.hadamard import deterministic_hadamard_matrix

    assert torch.equal(hadamard_matrix(n, normalize=False), deterministic_hadamard_matrix(n, torch.float64))


@pytest.mark.parametrize("n", [16, 32, 48, 96, 100, 768, 2560, 3072])
def test_random_matrix_is_compressed_tensors_random_hadamard_matrix(n):
    from compressed_tensors.transform.utils.hadamard import random_hadamard_matrix as ct_random_hadamard_matrix

    expected = ct_random_hadamard_matrix(n, torch.float64, gen=torch.Generator().manual_seed(3))
    assert torch.equal(random_hadamard_matrix(n, seed=3, normalize=False), expected)
    torch.testing.assert_close(random_hadamard_matrix(n, seed=3), expected / math.sqrt(n), rtol=0, atol=1e-15)


@pytest.mark.parametrize("n", [12, 20, 28, 3072])
def test_other_sizes_are_the_unsigned_random_hadamard_base(n):
    """compressed-tensors' "hadamard" type refuses these sizes; its random-hadamard matrix is diag(s) times ours."""
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 2 - 1
    unsigned = hadamard_matrix(n, normalize=False)
    assert torch.equal(random_hadamard_matrix(n, seed=5, normalize=False), signs[:, None] * unsigned)


def test_random_matrix_depends_on_the_seed_only():
    first = random_hadamard_matrix(128, seed=0)
    torch.manual_seed(123)  # the global generator plays no part
    assert torch.equal(random_hadamard_matrix(128, seed=0), first)
    assert not torch.equal(random_hadamard_matrix(128, seed=1), first)
    torch.testing.assert_close(first @ first.T, torch.eye(128, dtype=torch.float64), rtol=0, atol=1e-12)


def test_callers_get_a_copy_in_their_dtype():
    h = hadamard_matrix(64, dtype=torch.bfloat16)
    assert h.dtype == torch.bfloat16
    h.zero_()
    assert hadamard_matrix(64).abs().min() > 0


@pytest.mark.parametrize("n", [1, 2, 32, 64, 96, 3072, 14336])
@pytest.mark.parametrize("seed", [None, 7])
def test_transform_equals_the_matrix_product(n, seed):
    x = torch.randn(3, 2, n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = hadamard_transform(x, seed=seed)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)
    if n <= 4096:
        q = hadamard_matrix(n) if seed is None else random_hadamard_matrix(n, seed)
        torch.testing.assert_close(y, x @ q, rtol=0, atol=1e-12)


def test_transform_keeps_the_input_dtype_and_reads_transposed_input():
    w = torch.randn(16, 48, generator=torch.Generator().manual_seed(1))
    y = hadamard_transform(w.T)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, w.T @ hadamard_matrix(16, dtype=torch.float32))


@pytest.mark.parametrize("n", [0, 3, 6, 10, 260, 29568])  # 29568 = 231·2^7: Qwen2-72B's MLP width
def test_a_width_without_a_construction_is_refused_by_name(n):
    assert not is_supported_width(n)
    for build in (lambda: hadamard_matrix(n), lambda: random_hadamard_matrix(n, 0),
                  lambda: hadamard_transform(torch.zeros(1, n))):
        with pytest.raises(UnsupportedWidthError, match=rf"^no Hadamard matrix of size {n}: sizes supported are 2\^k"):
            build()
    assert isinstance(UnsupportedWidthError(n), ValueError)
