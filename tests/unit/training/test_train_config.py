import pytest

from quantkit.training import config as train_config
from quantkit.training.config import ConfigError, accumulation_steps

BASE = {"model": {"path": "m"}, "data": {"train": "t.txt"}}


def config(**sections):
    data = {**BASE, **sections}
    return train_config.from_dict(data)


def test_defaults_and_float_coercion():
    cfg = config(train={"lr": 1})
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float) and cfg.train.schedule == "cosine"


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"trian": {}}, "unknown key 'trian'"),
        ({"train": {"lr": "fast"}}, "train.lr: 'fast' is not allowed; expected float"),
        ({"train": {"max_steps": 1.5}}, "train.max_steps"),
        ({"train": {"schedule": "linear"}}, "train.schedule: 'linear' is not allowed; allowed: cosine, constant"),
        ({"train": {"precision": "fp8"}}, "train.precision"),
        ({"data": {"seq_len": 1, "train": "t.txt"}}, "data.seq_len: must be >= 2"),
        ({"train": {"eval_max_samples": 0}}, "train.eval_max_samples: must be >= 1"),
        ({"data": {}}, "data.train is required"),
        ({"model": {"path": "m", "config": {"model_type": "llama"}}}, "either model.path"),
        ({"model": {"config": {"hidden_size": 8}, "tokenizer": "t"}}, "model_type is required"),
        ({"model": {"config": {"model_type": "llama"}}}, "model.tokenizer is required"),
        ({"train": {"micro_batch": 4}}, "unknown key 'train.micro_batch'"),
        ({"model": {"config": {"model_type": "llama"}, "tokenizer": "t", "revision": "v1"}}, "model.revision is the revision of model.path"),
        ({"model": {"path": "org/m", "tokenizer_revision": "v1"}}, "model.tokenizer_revision is the revision of model.tokenizer"),
        ({"model": {"path": "org/m", "revision": 3}}, "model.revision: 3 is not allowed; expected str or null"),
    ],
)
def test_config_errors_name_the_key(sections, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        config(**sections)


def test_overrides_parse_values_as_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: m}\ndata: {train: t.txt}\ntrain: {lr: 0.1}\n")
    cfg = train_config.load(path, ["train.lr=1e-4", "train.max_steps=7", "qat_recipe=int4-weight-only"])
    assert (cfg.train.lr, cfg.train.max_steps, cfg.qat_recipe) == (1e-4, 7, "int4-weight-only")
    with pytest.raises(ConfigError, match="--set section.key=value"):
        train_config.load(path, ["train.lr"])


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        train_config.load(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is a directory; pass the training config, a YAML file"):
        train_config.load(tmp_path)
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ConfigError, match=r"empty\.yaml is empty; a training config needs at least model: \{path"):
        train_config.load(tmp_path / "empty.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        train_config.load(tmp_path / "list.yaml")


@pytest.mark.parametrize("world, expected", [(1, 4), (2, 2), (4, 1)])
def test_global_batch_is_kept_when_ranks_change(world, expected):
    cfg = config(train={"micro_batch_size": 4, "global_batch_size": 16})
    assert accumulation_steps(cfg, world) == expected


def test_global_batch_not_divisible_says_what_to_change():
    cfg = config(train={"micro_batch_size": 4, "global_batch_size": 12})
    with pytest.raises(ConfigError, match="micro_batch_size or --nproc-per-node"):
        accumulation_steps(cfg, 2)


@pytest.mark.parametrize("data, missing", [({"data": {"train": "t.txt"}}, "model"), ({"model": {"path": "m"}}, "data")])
def test_a_missing_section_is_named(data, missing):
    with pytest.raises(ConfigError, match=f"the config has no '{missing}' section; a training config needs at least"):
        train_config.from_dict(data)


def scratch(**params) -> train_config.ModelSection:
    return train_config.ModelSection(config={"model_type": "llama", **params}, tokenizer="t")


@pytest.mark.parametrize("params, message", [
    ({"hidden_sizee": 64}, "unknown key 'model.config.hidden_sizee' for model_type llama; did you mean 'hidden_size'?"),
    ({"model_type": "llamaX"}, "model.config.model_type: unknown model_type llamaX; did you mean llama"),
    ({"hidden_size": 64, "num_attention_heads": 5},
     "model.config: The hidden size (64) is not a multiple of the number of attention heads (5)."),
])
def test_model_config_mistakes_are_one_line(params, message):
    with pytest.raises(ConfigError) as caught:
        train_config.model_config(scratch(**params))
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value) and len(str(caught.value)) < 200


def test_model_config_takes_the_config_class_keys_and_its_aliases():
    built = train_config.model_config(scratch(hidden_size=64, num_attention_heads=4, tie_word_embeddings=True))
    assert (built.hidden_size, built.num_attention_heads, built.tie_word_embeddings) == (64, 4, True)
    gpt2 = train_config.ModelSection(config={"model_type": "gpt2", "hidden_size": 32, "n_layer": 1}, tokenizer="t")
    assert (train_config.model_config(gpt2).n_embd, train_config.model_config(gpt2).n_layer) == (32, 1)
