"""A dataset's fingerprint (elastic/data/fingerprint.py): what the resume check compares besides
the length. Cheap (a fixed sample of items), stable across processes and runs, and sensitive to
the items' values; the user's fingerprint() wins."""
from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from elastic.data.fingerprint import NUM_SAMPLED, dataset_fingerprint, sample_positions


class Items(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items, self.reads = items, []

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        self.reads.append(i)
        return self.items[i]


def mixed(k: int = 0):
    return [{"x": torch.arange(3, dtype=torch.bfloat16) + i + k, "y": np.array([i, 2 * i], dtype=np.int32),
             "label": f"item {i}", "w": 0.5 * i, "ok": i % 2 == 0, "none": None, "raw": b"\x00\x01",
             "pair": (i, [i + 1.0])} for i in range(20)]


def test_the_same_items_give_the_same_fingerprint_in_every_process_and_version():
    """The encoding is part of every checkpoint written since: changing it refuses every resume.
    This value was computed once; a change here must keep reading old fingerprints."""
    assert dataset_fingerprint(Items(mixed())) == "sample:20:bea4198188ebe94c"


def test_a_sample_of_items_is_read_and_any_value_in_it_counts():
    ds = Items(mixed())
    fp = dataset_fingerprint(ds)
    assert ds.reads == sample_positions(20) and len(ds.reads) == NUM_SAMPLED and ds.reads[-1] == 19
    assert dataset_fingerprint(Items(mixed(k=1))) != fp
    items = mixed()
    items[19]["pair"] = (19, [20.5])
    assert dataset_fingerprint(Items(items)) != fp
    items = mixed()
    items[0] = {k: items[0][k] for k in reversed(items[0])}  # key order does not count
    assert dataset_fingerprint(Items(items)) == fp
    assert dataset_fingerprint(Items(mixed() + mixed()[:1])) != fp  # another length
    assert sample_positions(3) == [0, 1, 2] and sample_positions(0) == []


def test_random_augmentation_is_read_seeded_and_the_callers_generators_are_left_where_they_were():
    class Augmented(Items):
        def __getitem__(self, i):
            return torch.rand(2) + random.random() + float(np.random.rand()) + i

    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    before = torch.rand(1), random.random(), np.random.rand()
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    assert dataset_fingerprint(Augmented([0] * 10)) == dataset_fingerprint(Augmented([0] * 10))
    assert (torch.rand(1), random.random(), np.random.rand()) == before


def test_items_of_unknown_types_count_by_type_with_a_warning(caplog):
    class Blob:
        pass

    with caplog.at_level(logging.WARNING, logger="elastic.data.fingerprint"):
        fp = dataset_fingerprint(Items([(Blob(), i) for i in range(5)]))
    assert fp == dataset_fingerprint(Items([(Blob(), i) for i in range(5)]))  # no memory addresses
    assert "Blob, fingerprinted by type only" in caplog.text and "fingerprint() method" in caplog.text


def test_a_datasets_own_fingerprint_is_used_and_must_be_a_string():
    class Own(Items):
        def fingerprint(self):
            return "corpus-2024-06"

    ds = Own(mixed())
    assert dataset_fingerprint(ds) == "user:corpus-2024-06" and ds.reads == []  # no item read

    class Bad(Items):
        def fingerprint(self):
            return 7

    with pytest.raises(ValueError, match="fingerprint\\(\\) returned 7: it must return a non-empty string"):
        dataset_fingerprint(Bad([]))
