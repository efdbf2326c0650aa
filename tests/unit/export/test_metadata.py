"""quantkit.json: how an artifact was made, written and read back."""

import json

from quantkit.export import metadata
from quantkit.quant import registry
from quantkit.quant.plan import ModulePlan


def test_build_write_read_round_trip(tmp_path):
    recipe = registry.resolve("int4-weight-only")
    plan = [ModulePlan("model.layers.0.mlp.down_proj", 176, 64, recipe.scheme.with_group_size(16), note="group size 128 -> 16"),
            ModulePlan("lm_head", 64, 512, None, note="ignored by recipe")]
    info = metadata.build(recipe, registry.Format.COMPRESSED_TENSORS, plan, tmp_path, "sha256:abc")
    metadata.write(tmp_path, info)
    read = metadata.read(tmp_path)
    assert read == json.loads(json.dumps(info))
    assert read["recipe"]["name"] == "int4-weight-only" and read["format"] == "compressed-tensors"
    assert read["source"] == {"path": str(tmp_path), "fingerprint": "sha256:abc", "qat_recipe": None}
    assert read["modules"]["left_out"] == [{"module": "lm_head", "reason": "ignored by recipe"}]
    assert {"quantkit", "torch", "transformers", "compressed-tensors"} <= set(read["versions"])


def test_reading_a_missing_or_broken_file_gives_none(tmp_path):
    assert metadata.read(tmp_path) is None
    (tmp_path / metadata.FILENAME).write_text("{broken")
    assert metadata.read(tmp_path) is None
