"""GGML types by name: each one's grid is the one the GGUF exporter maps back to the type, and its size is gguf's."""

import pytest

from quantkit.grids.schemes import SchemeError
from quantkit.quant import gguf_types

gguf = pytest.importorskip("gguf")


@pytest.mark.parametrize("name", [n for n in gguf_types.names() if n != gguf_types.FLOAT])
def test_each_type_is_its_grid_and_gguf_s_size(name):
    from quantkit.export.gguf import ggml_type

    assert ggml_type(gguf_types.spec(name)).name == name
    assert gguf_types.BLOCK_BYTES[name] == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]


def test_names_any_case_and_float():
    assert gguf_types.canonical("q6_k") == "Q6_K" and gguf_types.canonical(" Float ") == "float"
    assert gguf_types.spec("float") is None
    assert gguf_types.bits_per_weight("Q4_K") == 4.5 and gguf_types.bits_per_weight("Q8_0") == 8.5
    assert gguf_types.bits_per_weight("float", 16) == 16
    assert gguf_types.tensor_bytes("Q6_K", 3, 512) == 3 * 2 * 210 and gguf_types.tensor_bytes("float", 3, 512) == 3 * 512 * 2
    assert gguf_types.fits("Q4_0", 96) and not gguf_types.fits("Q4_K", 96)
    bits = [gguf_types.bits_per_weight(n) for n in gguf_types.names()[:-1]]
    assert bits == sorted(bits)


def test_an_unknown_type_names_the_known_ones():
    with pytest.raises(SchemeError, match="Q4_K"):
        gguf_types.canonical("q4_k_m")
