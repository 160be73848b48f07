"""Pre-started workers (elastic/group/prestart.py): where one takes a rank, and what config refuses.
The path itself runs on a real cluster in tests/test_chaos.py (a SIGKILLed rank replaced in place)."""
import pytest

from elastic.config import ConfigError, parse_job
from elastic.group.prestart import choose_node
from tests.test_config import job


def test_a_node_with_a_ready_worker_and_a_free_slot_is_chosen():
    ready = {"a": 1, "b": 1, "c": 0}
    # c has the most room but nothing started there; b has no free slot.
    assert choose_node(ready, {"a": 1.0, "b": 0.0, "c": 4.0}, 1.0) == "a"
    assert choose_node(ready, {"a": 0.5, "b": 0.0, "c": 4.0}, 1.0) is None  # half a slot is no slot
    assert choose_node({}, {"a": 1.0}, 1.0) is None


def test_the_node_whose_rank_died_comes_first_then_the_most_free_cpu():
    ready = {"a": 1, "b": 2, "c": 1}
    free = {"a": 1.0, "b": 3.0, "c": 1.0}
    assert choose_node(ready, free, 1.0) == "b"
    assert choose_node(ready, free, 1.0, prefer=("c",)) == "c"
    assert choose_node(ready, free, 1.0, prefer=("gone", "a")) == "a"
    assert choose_node({"a": 1, "c": 1}, {"a": 1.0, "c": 1.0}, 1.0) == "a"  # ties: name order


def test_prestarted_workers_are_refused_with_gpus_naming_the_field():
    with pytest.raises(ConfigError, match=r"scaling.prestarted_per_node is for CPU workers.*use_gpu"):
        parse_job(job(scaling={"num_workers": 3, "prestarted_per_node": 1, "use_gpu": True}))
    assert parse_job(job(scaling={"num_workers": 3, "prestarted_per_node": 2})).scaling.prestarted_per_node == 2
