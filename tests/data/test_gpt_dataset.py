"""GPT samples, splits, blending, --data-path parsing."""

import os

import numpy as np
import pytest

from megaulysses.data.gpt_dataset import (BlendedDataset, GPTDataset, MockGPTDataset,
                                          build_train_valid_test_datasets, parse_data_path,
                                          parse_split, split_boundaries)
from megaulysses.data.indexed import IndexedDataset, IndexedDatasetWriter

SEQ = 16


def make_dataset(prefix, n_docs=40, seed=0, empty_doc=5):
    """Documents of random length whose tokens encode (document, position)."""
    rng = np.random.RandomState(seed)
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for d in range(n_docs):
            length = 0 if d == empty_doc else rng.randint(1, 40)
            w.add_document(d * 1000 + np.arange(length))
    return IndexedDataset(prefix)


@pytest.fixture
def indexed(tmp_path):
    return make_dataset(str(tmp_path / "corpus"))


def doc_stream(ds):
    return np.concatenate([ds.indexed.get(int(d)) for d in ds.document_index])


def test_samples_have_seq_length_plus_one(indexed):
    ds = GPTDataset(indexed, np.arange(len(indexed)), 50, SEQ, 1, None, "train")
    assert len(ds) == 50
    for i in range(len(ds)):
        sample = ds[i]
        assert sample.dtype == np.int64 and sample.shape == (SEQ + 1,)
    with pytest.raises(IndexError):
        ds[50]


def test_unshuffled_samples_tile_the_stream_with_one_token_overlap(indexed):
    ds = GPTDataset(indexed, np.arange(len(indexed)), 120, SEQ, 1, None, "train")
    stream = doc_stream(ds)
    for i in range(len(ds)):
        np.testing.assert_array_equal(ds.unshuffled(i), stream[i * SEQ:i * SEQ + SEQ + 1])
    # the shuffle is a permutation of those samples
    assert sorted(ds.shuffle_index.tolist()) == list(range(120))
    np.testing.assert_array_equal(ds[0], ds.unshuffled(int(ds.shuffle_index[0])))


def test_multiple_epochs_each_shuffled(indexed):
    ids = np.arange(len(indexed))
    tokens = int(indexed.sequence_lengths.sum())
    n = 3 * tokens // SEQ  # about three epochs
    ds = GPTDataset(indexed, ids, n, SEQ, 3, None, "train")
    assert ds.num_epochs == -(-(n * SEQ + 1) // tokens) >= 3
    epochs = ds.document_index.reshape(ds.num_epochs, len(ids))
    for epoch in epochs:
        assert sorted(epoch.tolist()) == ids.tolist()
    assert not np.array_equal(epochs[0], epochs[1])
    assert len(doc_stream(ds)) >= n * SEQ + 1


def test_deterministic_and_seed_dependent(indexed):
    ids = np.arange(len(indexed))
    a = GPTDataset(indexed, ids, 60, SEQ, 7, None, "train")
    b = GPTDataset(indexed, ids, 60, SEQ, 7, None, "train")
    c = GPTDataset(indexed, ids, 60, SEQ, 8, None, "train")
    assert all(np.array_equal(a[i], b[i]) for i in range(60))
    assert not all(np.array_equal(a[i], c[i]) for i in range(60))


def test_cache_written_then_reused(indexed, tmp_path):
    cache = str(tmp_path / "cache")
    ids = np.arange(len(indexed))
    first = GPTDataset(indexed, ids, 60, SEQ, 7, cache, "train")
    files = sorted(os.listdir(cache))
    assert not first.loaded_from_cache
    assert len(files) == 3 and all(f.startswith("train_") and f.endswith(".npy") for f in files)
    second = GPTDataset(indexed, ids, 60, SEQ, 7, cache, "train")
    assert second.loaded_from_cache
    assert sorted(os.listdir(cache)) == files
    assert all(np.array_equal(first[i], second[i]) for i in range(60))
    # any change in the inputs means another cache entry
    other = GPTDataset(indexed, ids, 61, SEQ, 7, cache, "train")
    assert not other.loaded_from_cache and len(os.listdir(cache)) == 6


def test_empty_split_with_samples_is_an_error(indexed):
    with pytest.raises(ValueError, match="valid split"):
        GPTDataset(indexed, np.arange(0), 10, SEQ, 1, None, "valid")
    with pytest.raises(ValueError, match="valid split"):
        GPTDataset(indexed, np.array([5]), 10, SEQ, 1, None, "valid")  # the empty document
    assert len(GPTDataset(indexed, np.arange(0), 0, SEQ, 1, None, "valid")) == 0


# ---------------------------------------------------------------- splits


def test_parse_split():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("98,2,0") == pytest.approx([0.98, 0.02, 0.0])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    assert parse_split("3,1") == [0.75, 0.25, 0.0]
    for bad in ["", "a,b", "1,2,3,4", "0,0,0", "-1,2,0", "1,,1", "nan", "inf,1"]:
        with pytest.raises(ValueError, match="^--split: "):
            parse_split(bad)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 100, 781, 1001])
@pytest.mark.parametrize("split", ["969,30,1", "98,2,0", "1", "1,1,1", "0,0,1"])
def test_every_document_in_exactly_one_split(n, split):
    bounds = split_boundaries(n, parse_split(split))
    assert bounds[0] == 0 and bounds[-1] == n
    assert bounds == sorted(bounds)
    owners = [[k for k in range(3) if bounds[k] <= d < bounds[k + 1]] for d in range(n)]
    assert all(len(o) == 1 for o in owners)


def test_split_sizes_follow_weights():
    assert split_boundaries(1000, parse_split("969,30,1")) == [0, 969, 999, 1000]
    assert split_boundaries(781, parse_split("969,30,1")) == [0, 757, 780, 781]


# ---------------------------------------------------------------- blending


def test_blending_proportions_and_determinism(tmp_path):
    parts = [make_dataset(str(tmp_path / f"c{k}"), seed=k) for k in range(3)]
    weights = [0.5, 0.3, 0.2]
    n = 10_000
    members = [GPTDataset(p, np.arange(len(p)), int(np.ceil(w * n * 1.005)) + 1, SEQ, 1, None,
                          f"m{k}") for k, (p, w) in enumerate(zip(parts, weights, strict=True))]
    blend = BlendedDataset(members, [5, 3, 2], n, 1, str(tmp_path / "cache"), "train")
    counts = np.bincount(blend.dataset_index, minlength=3) / n
    assert np.all(np.abs(counts - weights) < 0.01)
    # each member is read in order 0, 1, 2, ... so none is over-used
    for k in range(3):
        used = blend.dataset_sample_index[blend.dataset_index == k]
        assert used.tolist() == list(range(len(used)))
    again = BlendedDataset(members, [5, 3, 2], n, 1, str(tmp_path / "cache"), "train")
    assert again.loaded_from_cache
    np.testing.assert_array_equal(again.dataset_index, blend.dataset_index)
    k, j = int(blend.dataset_index[123]), int(blend.dataset_sample_index[123])
    np.testing.assert_array_equal(blend[123], members[k][j])


def test_blending_greedy_rule_and_ties():
    from megaulysses.data.gpt_dataset import _build_blending_indices

    out = _build_blending_indices([0.5, 0.5], 6)
    assert out["dataset_index"].tolist() == [0, 1, 0, 1, 0, 1]
    assert out["dataset_sample_index"].tolist() == [0, 0, 1, 1, 2, 2]


def test_blending_refuses_too_small_members(indexed):
    small = GPTDataset(indexed, np.arange(len(indexed)), 3, SEQ, 1, None, "a")
    with pytest.raises(ValueError, match="needs"):
        BlendedDataset([small, small], [0.5, 0.5], 20, 1, None, "train")


# ---------------------------------------------------------------- --data-path


def test_parse_data_path_forms():
    assert parse_data_path(["A"]) == (["A"], [1.0])
    assert parse_data_path(["A", "B", "C"]) == (["A", "B", "C"], [1.0, 1.0, 1.0])
    assert parse_data_path(["0.3", "A", "0.7", "B"]) == (["A", "B"], [0.3, 0.7])
    assert parse_data_path(["1", "A"]) == (["A"], [1.0])


@pytest.mark.parametrize("bad", [[], ["0.3", "A", "0.7"], ["A", "0.3", "B"], ["x", "A", "1", "B"],
                                 ["0.3", "A", "B", "C"], ["0", "A", "1", "B"],
                                 ["-1", "A", "2", "B"]])
def test_parse_data_path_errors(bad):
    with pytest.raises(ValueError, match="^--data-path:"):
        parse_data_path(bad)


# ---------------------------------------------------------------- train/valid/test


def test_build_single_prefix(tmp_path):
    make_dataset(str(tmp_path / "c"), n_docs=100)
    train, valid, test = build_train_valid_test_datasets(
        [str(tmp_path / "c")], [1.0], "80,20,0", (50, 10, 0), SEQ, 1, None)
    assert isinstance(train, GPTDataset) and isinstance(valid, GPTDataset) and test is None
    assert train.document_ids.tolist() == list(range(80))
    assert valid.document_ids.tolist() == list(range(80, 100))
    assert len(train) == 50 and len(valid) == 10


def test_build_blended(tmp_path):
    for k in range(2):
        make_dataset(str(tmp_path / f"c{k}"), n_docs=50, seed=k)
    prefixes = [str(tmp_path / "c0"), str(tmp_path / "c1")]
    train, valid, test = build_train_valid_test_datasets(
        prefixes, [0.25, 0.75], "90,10,0", (400, 40, 0), SEQ, 1, str(tmp_path / "cache"))
    assert isinstance(train, BlendedDataset) and isinstance(valid, BlendedDataset)
    assert test is None and len(train) == 400 and train[399].shape == (SEQ + 1,)
    assert len(train.datasets[0]) == int(np.ceil(0.25 * 400 * 1.005)) + 1


def test_build_empty_split_with_samples_names_split(tmp_path):
    make_dataset(str(tmp_path / "c"), n_docs=10)
    prefix = [str(tmp_path / "c")]
    with pytest.raises(ValueError, match="^--split: .*test split"):
        build_train_valid_test_datasets(prefix, [1.0], "90,10,0", (10, 1, 1), SEQ, 1, None)
    # 2% of 10 documents rounds to none
    with pytest.raises(ValueError, match="^--split: .*valid split"):
        build_train_valid_test_datasets(prefix, [1.0], "98,2,0", (10, 1, 0), SEQ, 1, None)


def test_mock_dataset_is_deterministic():
    a, b = MockGPTDataset(10, SEQ, 100, 3), MockGPTDataset(10, SEQ, 100, 3)
    assert len(a) == 10 and a[4].shape == (SEQ + 1,) and a[4].dtype == np.int64
    np.testing.assert_array_equal(a[4], b[4])
    assert not np.array_equal(a[4], a[5])
    assert not np.array_equal(a[4], MockGPTDataset(10, SEQ, 100, 4)[4])
    assert a[4].max() < 100 and a[4].min() >= 0
