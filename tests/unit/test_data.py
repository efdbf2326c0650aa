"""quantkit.data: dataset specs to texts, tokens, evaluation windows and calibration blocks."""

from __future__ import annotations

import json

import datasets
import pytest
import torch

from quantkit.data import eval_windows, load_texts, parse_hub_spec, rank_batches, rank_slice, sample_blocks, tokenize
from quantkit.errors import DataError, UsageError

# ---------------------------------------------------------------- local files


def test_txt_file_is_one_document(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("first line\n\nsecond paragraph\n")
    assert load_texts(str(path)) == ["first line\n\nsecond paragraph\n"]


def test_jsonl_takes_the_field_and_skips_blank_lines(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"body": "one", "id": 1}\n\n{"body": "two", "id": 2}\n')
    assert load_texts(str(path), text_field="body") == ["one", "two"]


def test_jsonl_bad_line_names_the_line_number(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "fine"}\n{"text": broken}\n')
    with pytest.raises(DataError, match=r"corpus\.jsonl:2 is not valid JSON"):
        load_texts(str(path))


def test_jsonl_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('["a", "b"]\n')
    with pytest.raises(DataError, match=r":1 is a JSON list, not an object"):
        load_texts(str(path))


def test_jsonl_missing_field_names_field_line_and_fields(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "ok"}\n{"content": "no text here"}\n')
    with pytest.raises(DataError, match=r":2 has no field 'text' \(fields: content\); put the text under 'text'$"):
        load_texts(str(path))


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_missing_field_ends_with_the_callers_advice_not_a_flag_it_cannot_know(tmp_path, suffix):
    """eval and finalize name their --text-field, train its config's data.text_field: data.py names neither itself."""
    table, path = datasets.Dataset.from_dict({"content": ["alpha"]}), tmp_path / f"corpus{suffix}"
    (table.to_json if suffix == ".jsonl" else table.to_parquet)(str(path))
    with pytest.raises(DataError) as info:
        load_texts(str(path), field_advice="set data.text_field in the config")
    assert str(info.value).endswith(": content); set data.text_field in the config"), str(info.value)
    assert "--text-field" not in str(info.value)


def test_jsonl_non_string_field(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": 3}\n')
    with pytest.raises(DataError, match="field 'text' is a int, not a string"):
        load_texts(str(path))


def test_parquet_column(tmp_path):
    path = tmp_path / "corpus.parquet"
    datasets.Dataset.from_dict({"content": ["alpha", "beta"], "n": [1, 2]}).to_parquet(str(path))
    assert load_texts(str(path), text_field="content") == ["alpha", "beta"]


def test_parquet_missing_column_lists_columns(tmp_path):
    path = tmp_path / "corpus.parquet"
    datasets.Dataset.from_dict({"content": ["alpha"]}).to_parquet(str(path))
    with pytest.raises(DataError, match=r"no column 'text' \(columns: content\)"):
        load_texts(str(path))


def test_missing_local_file_says_what_to_pass(tmp_path):
    missing = tmp_path / "nope.txt"
    expected = f"{missing} does not exist; pass a .txt/.jsonl/.parquet file or a datasets spec like wikitext:wikitext-2-raw-v1:test"
    with pytest.raises(DataError) as info:
        load_texts(str(missing))
    assert str(info.value) == expected


def test_existing_file_with_unknown_extension(tmp_path):
    path = tmp_path / "corpus.csv"
    path.write_text("text\nhello\n")
    with pytest.raises(DataError, match="unknown file type '.csv'"):
        load_texts(str(path))


def test_local_dataset_directory_goes_through_the_real_datasets_loader(tmp_path):
    """The code path hub names take (`datasets.load_dataset(name, config, split=...)`), on local data."""
    root = tmp_path / "my-dataset"
    root.mkdir()
    (root / "train.jsonl").write_text(json.dumps({"text": "train text"}) + "\n")
    (root / "test.jsonl").write_text(json.dumps({"text": "first"}) + "\n" + json.dumps({"text": "second"}) + "\n")
    assert load_texts(str(root)) == ["first", "second"]  # default split: test
    assert load_texts(f"{root}:default:train") == ["train text"]


def test_directory_without_data_is_one_data_error(tmp_path):
    with pytest.raises(DataError, match="cannot load datasets spec"):
        load_texts(str(tmp_path))


@pytest.mark.parametrize("name, content", [("empty.txt", ""), ("empty.jsonl", '{"text": ""}\n\n')])
def test_empty_text_is_an_error(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match="has no text"):
        load_texts(str(path))


# ---------------------------------------------------------------- text, or not


WORLD_TEXT = ("Zürich, São Paulo, Kraków: crème brûlée, naïve façade. 東京は日本の首都です。北京是中国的首都。"
              "서울은 한국의 수도입니다. Привет, мир! Γειά σου κόσμε. مرحبا بالعالم. नमस्ते दुनिया. 🎉🚀👩‍💻 ✓ — «quotes»\n")


@pytest.mark.parametrize("name", ["world.txt", "world.jsonl", "world.parquet"])
def test_utf8_text_in_any_script_is_text(tmp_path, name):
    path = tmp_path / name
    if name.endswith(".txt"):
        path.write_text(WORLD_TEXT * 50, encoding="utf-8")
    elif name.endswith(".jsonl"):
        path.write_text("\n".join(json.dumps({"text": WORLD_TEXT}) for _ in range(50)), encoding="utf-8")
    else:
        datasets.Dataset.from_dict({"text": [WORLD_TEXT] * 50}).to_parquet(str(path))
    assert "".join(load_texts(str(path))).count("東京") == 50


def test_a_few_bytes_that_are_not_utf8_still_pass(tmp_path):
    """A Latin-1 file with an accent here and there (about 1 character in 100): decoded with replacements, as before."""
    path = tmp_path / "latin1.txt"
    path.write_bytes(("The café was open late that night, and the river ran high. " * 40).encode("latin-1"))
    (text,) = load_texts(str(path))
    assert text.count("\ufffd") == 40


def test_random_bytes_named_txt_are_refused_naming_the_file(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_bytes(torch.randint(0, 256, (50_000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8).numpy().tobytes())
    with pytest.raises(DataError, match=rf"^{path} is not text: \d+% of its first [\d,]+ characters are control characters "
                                        r"or bytes that are not UTF-8; pass UTF-8 text"):
        load_texts(str(path))


def test_a_text_field_of_control_characters_is_refused(tmp_path):
    path = tmp_path / "calib.jsonl"
    path.write_text("\n".join(json.dumps({"text": "\x00\x01\x02\x1b" * 20 + "ab"}) for _ in range(10)))
    with pytest.raises(DataError, match=r"calib\.jsonl is not text: 98% of its first 820 characters"):
        load_texts(str(path))


def test_only_the_first_characters_are_judged(tmp_path):
    """The check stays cheap on a large file: text at the start passes whatever follows it."""
    path = tmp_path / "big.txt"
    path.write_bytes(b"plain words " * 6000 + bytes(range(256)) * 400)
    assert load_texts(str(path))


# ---------------------------------------------------------------- hub specs


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("wikitext:wikitext-2-raw-v1:test", ("wikitext", "wikitext-2-raw-v1", "test")),
        ("wikitext:wikitext-2-raw-v1", ("wikitext", "wikitext-2-raw-v1", "test")),
        ("org/corpus", ("org/corpus", None, "test")),
        ("c4:en:validation", ("c4", "en", "validation")),
    ],
)
def test_parse_hub_spec(spec, expected):
    assert parse_hub_spec(spec) == expected


@pytest.mark.parametrize("spec", ["a:b:c:d", "name::test", ":config"])
def test_malformed_hub_spec(spec):
    with pytest.raises(DataError, match="not a file or a datasets spec"):
        parse_hub_spec(spec)


def test_hub_spec_loads_named_split(monkeypatch):
    calls = []

    def fake_load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        return datasets.Dataset.from_dict({"text": ["x", "", "y"]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_texts("wikitext:wikitext-2-raw-v1") == ["x", "", "y"]
    assert calls == [("wikitext", "wikitext-2-raw-v1", "test")]


def test_hub_failure_is_one_data_error(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'wikitext' on the Hub\nlong traceback text")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError) as info:
        load_texts("wikitext:wikitext-2-raw-v1:test")
    message = str(info.value)
    assert "'wikitext:wikitext-2-raw-v1:test'" in message and "Couldn't reach 'wikitext'" in message
    assert "\n" not in message and "local .txt/.jsonl/.parquet" in message


def test_hub_dataset_without_the_column(monkeypatch):
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_dict({"sentence": ["x"]}))
    with pytest.raises(DataError, match="no column 'text'"):
        load_texts("glue:sst2:validation")


# ---------------------------------------------------------------- tokenize


@pytest.fixture(scope="module")
def tokenizer():
    from quantkit.models.tiny import train_tokenizer

    return train_tokenizer("the quick brown fox jumps over the lazy dog\n" * 50, vocab_size=300)


def test_tokenize_joins_with_blank_lines_without_special_tokens(tokenizer):
    ids = tokenize(tokenizer, ["the quick fox", "the lazy dog"])
    expected = tokenizer("the quick fox\n\nthe lazy dog", add_special_tokens=False)["input_ids"]
    assert ids.dtype == torch.long and ids.dim() == 1
    assert ids.tolist() == expected
    assert tokenizer.bos_token_id not in ids.tolist()


def test_tokenize_empty_is_an_error(tokenizer):
    with pytest.raises(DataError, match="gives no tokens"):
        tokenize(tokenizer, [""])


# ---------------------------------------------------------------- eval windows


def _scored_positions(windows):
    return [t for _, end, target_begin in windows for t in range(target_begin, end)]


@pytest.mark.parametrize(
    "num_tokens, seq_len, stride",
    [
        (2, 2, None), (10, 2, None), (10, 2, 1), (100, 10, None), (100, 10, 10), (100, 10, 9),
        (100, 10, 5), (100, 10, 1), (101, 10, 3), (7, 512, None), (7, 512, 128), (1000, 64, 17), (64, 64, None),
    ],
)
def test_windows_score_every_token_but_the_first_exactly_once(num_tokens, seq_len, stride):
    windows = eval_windows(num_tokens, seq_len, stride, None)
    assert _scored_positions(windows) == list(range(1, num_tokens))
    for begin, end, target_begin in windows:
        assert 0 <= begin < target_begin < end <= num_tokens  # every window has context and scores something
        assert end - begin <= seq_len


def test_only_the_last_window_is_shorter():
    windows = eval_windows(100, 16, 4, None)
    assert {end - begin for begin, end, _ in windows[:-1]} == {16}
    assert windows[-1][1] == 100


def test_stride_below_seq_len_matches_the_hugging_face_windows():
    # HF "perplexity of fixed-length models": begin = k * stride, end = begin + seq_len, targets from the previous end.
    windows = eval_windows(1000, 64, 16, None)
    assert windows[:3] == [(0, 64, 1), (16, 80, 64), (32, 96, 80)]
    assert all(target_begin - begin == 48 for begin, _, target_begin in windows[1:])


def test_stride_none_is_seq_len_and_overlaps_by_the_one_context_token():
    windows = eval_windows(30, 10, None, None)
    assert windows == eval_windows(30, 10, 10, None)
    assert windows == [(0, 10, 1), (9, 19, 10), (18, 28, 19), (27, 30, 28)]


def test_max_samples_keeps_the_first_windows():
    assert eval_windows(1000, 64, 16, 3) == eval_windows(1000, 64, 16, None)[:3]
    assert eval_windows(10, 64, None, 5) == [(0, 10, 1)]


@pytest.mark.parametrize(
    "args, match",
    [
        ((100, 1, None, None), "seq_len must be at least 2"),
        ((100, 10, 0, None), "--stride must be between 1 and --seq-len 10"),
        ((100, 10, 11, None), "--stride must be between 1 and --seq-len 10"),
        ((100, 10, None, 0), "max_samples must be at least 1"),
        ((1, 10, None, None), "perplexity needs at least 2"),
    ],
)
def test_window_arguments_are_checked(args, match):
    with pytest.raises(DataError, match=match):
        eval_windows(*args)


# ---------------------------------------------------------------- calibration blocks


def test_sample_blocks_are_contiguous_slices():
    ids = torch.arange(1000)
    blocks = sample_blocks(ids, num_samples=8, seq_len=32, seed=0)
    assert blocks.shape == (8, 32) and blocks.dtype == ids.dtype
    assert torch.equal(blocks - blocks[:, :1], torch.arange(32).expand(8, 32))
    assert int(blocks.max()) <= 999


def test_sample_blocks_are_deterministic_by_seed():
    ids = torch.arange(5000)
    assert torch.equal(sample_blocks(ids, 16, 64, seed=3), sample_blocks(ids, 16, 64, seed=3))
    assert not torch.equal(sample_blocks(ids, 16, 64, seed=3), sample_blocks(ids, 16, 64, seed=4))


def test_sample_blocks_leave_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    sample_blocks(torch.arange(100), 4, 10, seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_sample_blocks_at_minimum_length():
    blocks = sample_blocks(torch.arange(41), num_samples=4, seq_len=10)
    assert blocks.shape == (4, 10) and int(blocks.max()) <= 40


@pytest.mark.parametrize("tokens, num_samples, fewer", [(10, 1, ", or at most --seq-len 9 at this --num-samples$"),
                                                        (9, 2, ", or at most --seq-len 4 at this --num-samples$"),
                                                        (40, 4, ", or at most --num-samples 3 at this --seq-len$"),
                                                        (100, 64, ", or at most --num-samples 9 at this --seq-len$"),
                                                        (3, 2, ", or --num-samples 1 --seq-len 2$"),
                                                        (2, 1, "$")])
def test_too_little_calibration_text_is_refused_saying_how_much_there_is(tokens, num_samples, fewer):
    """...and what would fit, a setting that does (never --num-samples 0): fewer samples, shorter ones, or one."""
    with pytest.raises(DataError, match=f"gives {tokens} tokens; --num-samples {num_samples} x --seq-len 10 needs at "
                                        f"least {num_samples * 10 + 1}; pass more text{fewer}"):
        sample_blocks(torch.arange(tokens), num_samples=num_samples, seq_len=10)


@pytest.mark.parametrize("tokens, num_samples", [(10, 1), (9, 2), (3, 2), (40, 4), (100, 64)])
def test_the_advice_for_too_little_text_fits(tokens, num_samples):
    import re

    with pytest.raises(DataError) as refused:
        sample_blocks(torch.arange(tokens), num_samples=num_samples, seq_len=10)
    advice = dict(re.findall(r"--(num-samples|seq-len) (\d+)", str(refused.value).split("; pass more text")[1]))
    fits = sample_blocks(torch.arange(tokens), num_samples=int(advice.get("num-samples", num_samples)),
                         seq_len=int(advice.get("seq-len", 10)))
    assert fits.numel() > 0


def test_too_little_calibration_text_names_the_data():
    with pytest.raises(DataError, match=r"^the calibration data calib\.txt gives 40 tokens; --num-samples 4 x --seq-len 10 needs at least 41"):
        sample_blocks(torch.arange(40), num_samples=4, seq_len=10, source="the calibration data calib.txt")


# ---------------------------------------------------------------- rank slices


@pytest.mark.parametrize("num_samples", [0, 1, 5, 7, 128, 129])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8, 16])
def test_rank_slices_split_contiguously_and_evenly(num_samples, world_size):
    slices = [rank_slice(num_samples, rank, world_size) for rank in range(world_size)]
    assert [i for s in slices for i in s] == list(range(num_samples))
    assert all(s.step == 1 for s in slices)
    sizes = [len(s) for s in slices]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("args", [(10, 2, 2), (10, -1, 2), (10, 0, 0), (-1, 0, 1)])
def test_rank_slice_rejects_bad_ranks(args):
    with pytest.raises(UsageError):
        rank_slice(*args)


def test_local_suffix_without_file_is_not_sent_to_the_hub(monkeypatch, tmp_path):
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("hub must not be called"))
    with pytest.raises(DataError, match="does not exist"):
        load_texts(str(tmp_path / "typo.jsonl"))


# ---------------------------------------------------------------- training batches

from quantkit.data import micro_batches, pack_blocks  # noqa: E402


def test_pack_blocks_drops_the_remainder():
    blocks = pack_blocks(torch.arange(10), 3)
    assert blocks.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(DataError, match="fewer than one block"):
        pack_blocks(torch.arange(2), 3)


@pytest.mark.parametrize("step", [0, 1, 2, 5])
def test_the_global_batch_does_not_depend_on_the_number_of_ranks(step):
    def global_batch(world: int, micro: int) -> list[int]:
        return sorted(i for rank in range(world) for mb in micro_batches(50, 8, micro, rank, world, 3, step) for i in mb)

    one = global_batch(1, 2)
    assert len(one) == 8 and len(set(one)) == 8
    assert global_batch(2, 2) == one == global_batch(4, 1) == global_batch(2, 4)


def test_epochs_reshuffle_and_cover_each_sample_once():
    steps_per_epoch = 48 // 8
    epoch = [i for s in range(steps_per_epoch) for mb in micro_batches(48, 8, 4, 0, 1, 0, s) for i in mb]
    assert sorted(epoch) == list(range(48))
    next_epoch = [i for mb in micro_batches(48, 8, 4, 0, 1, 0, steps_per_epoch) for i in mb]
    assert next_epoch != epoch[:8]


def test_fewer_blocks_than_a_global_batch():
    with pytest.raises(DataError, match="fewer than one global batch"):
        micro_batches(5, 8, 4, 0, 1, 0, 0)


@pytest.mark.parametrize("num_samples,batch_size,world_size", [(64, 8, 2), (64, 8, 3), (20, 8, 2), (10, 8, 4), (3, 8, 2)])
def test_rank_batches_share_out_whole_batches(num_samples, batch_size, world_size):
    single = [list(r) for r in rank_batches(num_samples, batch_size, 0, 1)]
    assert single == [list(range(i, min(i + batch_size, num_samples))) for i in range(0, num_samples, batch_size)]
    shared = [list(r) for rank in range(world_size) for r in rank_batches(num_samples, batch_size, rank, world_size)]
    assert sorted(i for batch in shared for i in batch) == list(range(num_samples))  # disjoint and complete
    if len(single) >= world_size:
        assert shared == single  # the very same batches, in order
        assert all(rank_batches(num_samples, batch_size, rank, world_size) for rank in range(world_size))
