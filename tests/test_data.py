from collections import Counter

import pytest

from elastic.data.order import GlobalOrder, cursor_after


def test_every_sample_of_an_epoch_exactly_once():
    order = GlobalOrder(num_samples=100, seed=3)
    for epoch in range(3):
        got = order.indices(epoch * 100, (epoch + 1) * 100)
        assert sorted(got) == list(range(100))
    # epochs are shuffled differently
    assert order.indices(0, 100) != order.indices(100, 200)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6])
def test_rank_slices_tile_the_global_batch_for_any_world_size(world_size):
    order, batch = GlobalOrder(num_samples=50, seed=0), 12
    for step in range(10):  # crosses epoch boundaries (50 is not a multiple of 12)
        union = [i for r in range(world_size) for i in order.rank_indices(step, batch, world_size, r)]
        assert union == order.indices(step * batch, (step + 1) * batch)


def test_resizes_mid_run_still_see_each_sample_once_per_epoch():
    order, batch, n = GlobalOrder(num_samples=96, seed=1), 24, 96
    seen = Counter()
    worlds = [3, 3, 2, 4, 1, 2, 3, 4]  # world size changes at every step boundary
    for step, w in enumerate(worlds):
        for r in range(w):
            for i in order.rank_indices(step, batch, w, r):
                seen[(step * batch) // n, i] += 1
    assert all(c == 1 for c in seen.values())
    assert len(seen) == len(worlds) * batch


def test_cursor_is_positions_consumed():
    assert cursor_after(0, 32) == 0
    assert cursor_after(7, 32) == 224


def test_empty_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="dataset is empty"):
        GlobalOrder(num_samples=0, seed=0)


def test_ledger_check_catches_a_repeated_or_wrong_sample(tmp_path):
    import json

    from tests.ray_fixtures import assert_exact_once

    order, batch = GlobalOrder(num_samples=12, seed=5), 6
    good = {str(s + 1): {"world_size": 2, "ranks": {str(r): order.rank_indices(s, batch, 2, r) for r in range(2)}}
            for s in range(4)}
    path = tmp_path / "ledger.json"
    path.write_text(json.dumps(good))
    assert_exact_once(path, 4, batch, 12, seed=5)
    bad = json.loads(json.dumps(good))
    bad["3"]["ranks"]["1"] = bad["1"]["ranks"]["1"]  # a step that trained on samples seen before
    path.write_text(json.dumps(bad))
    with pytest.raises(AssertionError, match="step 3 rank 1"):
        assert_exact_once(path, 4, batch, 12, seed=5)
