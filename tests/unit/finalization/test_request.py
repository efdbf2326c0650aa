"""The request check (`finalization.request`): the refusals the command line and the recipe decide, torch-free,
shared by the CLI (before torch loads) and `prepare` (the Python API)."""

import subprocess
import sys

import pytest

from quantkit.errors import DestinationExistsError, UsageError
from quantkit.finalization import checks
from quantkit.finalization.request import Request, check_request
from quantkit.quant import registry


def _request(tmp_path, **fields) -> Request:
    recipe = registry.resolve(fields.pop("recipe", "int4-weight-only"))
    return Request(src=tmp_path / "src", recipe=recipe, fmt=fields.pop("fmt", recipe.format), **fields)


def test_it_imports_no_torch():
    code = "import sys, quantkit.finalization.request; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("fields, error, says", [
    ({"dst": "out.gguf"}, UsageError, "compressed-tensors: pass --format gguf"),
    ({"recipe": "gguf-q4-0", "dst": "out"}, UsageError, "name DST with .gguf"),
    ({"recipe": "gguf-q4-0", "dst": "out.gguf", "max_shard_size": "1GB"}, UsageError, "drop --max-shard-size"),
    ({"dtype": "float64"}, UsageError, "--dtype float64: use one of"),
    ({"dst": "", "overwrite": True}, DestinationExistsError, "holds the source model"),
])
def test_what_the_request_alone_decides_is_refused_in_one_line(tmp_path, fields, error, says):
    (tmp_path / "src").mkdir()
    if "dst" in fields:
        fields["dst"] = tmp_path / fields["dst"]
    with pytest.raises(error, match=says) as raised:
        check_request(_request(tmp_path, **fields))
    assert "\n" not in str(raised.value)


def test_an_existing_destination_needs_overwrite(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "out").mkdir()
    with pytest.raises(DestinationExistsError):
        check_request(_request(tmp_path, dst=tmp_path / "out"))
    assert check_request(_request(tmp_path, dst=tmp_path / "out", overwrite=True, max_shard_size="2GB")) == 2 * 10 ** 9


def test_prepare_makes_the_same_check(tiny_model_dir, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(checks, "check_request", lambda request: seen.append(request) or None)
    checks.prepare(tiny_model_dir, registry.resolve("int4-weight-only"), dst=tmp_path / "out", dtype="bfloat16")
    assert [(r.dst, r.dtype) for r in seen] == [(tmp_path / "out", "bfloat16")]


@pytest.mark.parametrize("weights, tensor_types", [
    ({"dtype": "iq2_xxs", "granularity": "group", "group_size": 32, "scale_dtype": "k_quant"}, []),
    ({"dtype": "int4", "granularity": "group", "group_size": 32, "scale_dtype": "float16"}, ["ffn_up=iq1_m"]),
])
def test_the_types_llama_cpp_writes_only_with_an_importance_matrix_need_a_calibrated_recipe(tmp_path, weights, tensor_types):
    """llama.cpp refuses IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS and IQ2_S without an imatrix: a recipe that reads no data is
    refused in one line, the recipe's type or a per-tensor one; a calibrated one passes (its data is checked later)."""
    (tmp_path / "src").mkdir()
    recipe = registry.parse_recipe("rtn-low", {"scheme": {"weights": weights}, "format": "gguf", "tensor_types": tensor_types})
    with pytest.raises(UsageError, match=r"needs an importance matrix.*pass --calib-data FILE") as raised:
        check_request(Request(src=tmp_path / "src", recipe=recipe, fmt=recipe.format))
    assert "\n" not in str(raised.value)
    for name in ("gguf-iq2-xxs", "gguf-iq1-s", "gguf-iq3-xxs"):
        check_request(_request(tmp_path, recipe=name))


def test_q2_k_s_needs_a_recipe_that_reads_data(tmp_path):
    """llama.cpp refuses Q2_K_S without an importance matrix: the mixture from a round-to-nearest recipe is refused
    in one line naming --calib-data; gguf-q2-k-s (GPTQ) passes here (its data is checked by `prepare`)."""
    (tmp_path / "src").mkdir()
    rtn = registry.parse_recipe("rtn-q2-k-s", {**registry.resolve("gguf-q2-k-s").to_file(), "algorithm": {"name": "rtn"}})
    with pytest.raises(UsageError, match=r"Q2_K_S needs an importance matrix.*gguf-q2-k-s.*--calib-data") as raised:
        check_request(Request(src=tmp_path / "src", recipe=rtn, fmt=rtn.format))
    assert "\n" not in str(raised.value)
    check_request(_request(tmp_path, recipe="gguf-q2-k-s"))


def test_mxfp4_per_tensor_is_the_mxfp4_recipe_in_compressed_tensors(tmp_path):
    """MXFP4 is a GGML type and recipe `mxfp4`'s grid: compressed-tensors takes `--tensor-type X=mxfp4` as that
    recipe (the same weights); a GGML type no recipe is named after stays GGUF's."""
    (tmp_path / "src").mkdir()
    recipe = registry.with_tensor_types(registry.resolve("int4-weight-only"), ["ffn_down=mxfp4"])
    check_request(Request(src=tmp_path / "src", recipe=recipe, fmt=recipe.format))
    assert registry.tensor_type_spec("MXFP4") == registry.resolve("mxfp4").scheme.weights
    recipe = registry.with_tensor_types(registry.resolve("int4-weight-only"), ["ffn_down=q4_k"])
    with pytest.raises(UsageError, match="use --format gguf"):
        check_request(Request(src=tmp_path / "src", recipe=recipe, fmt=recipe.format))
