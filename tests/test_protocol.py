"""The real worker group and the fake one the controller tests step against implement one
`WorkerGroupProtocol`: same methods, same parameter names and defaults, same attributes. A
method renamed or re-signed on one side and not the other fails here, not silently in a run."""
from __future__ import annotations

import inspect
import json
from dataclasses import fields

import pytest

from elastic.group.worker_group import WorkerGroup
from elastic.protocol import LostCause, PollReport, RankStatus, RunStatus, WorkerGroupProtocol
from tests.support.fake_group import FakeGroup

METHODS = sorted(n for n, v in vars(WorkerGroupProtocol).items() if callable(v) and not n.startswith("_"))
ATTRIBUTES = sorted(WorkerGroupProtocol.__annotations__)


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("group", [WorkerGroup, FakeGroup], ids=["real", "fake"])
@pytest.mark.parametrize("method", METHODS)
def test_every_protocol_method_has_the_protocols_signature(group, method):
    assert hasattr(group, method), f"{group.__name__} lacks {method}()"
    assert _params(getattr(group, method)) == _params(getattr(WorkerGroupProtocol, method))


def test_every_protocol_attribute_is_set_by_both_groups():
    fake = {f.name for f in fields(FakeGroup)}
    real = "".join(inspect.getsource(c) for c in WorkerGroup.__mro__ if c.__module__.startswith("elastic."))
    assert [a for a in ATTRIBUTES if a not in fake] == []
    assert [a for a in ATTRIBUTES if f"self.{a} =" not in real and f"self.{a}:" not in real] == []


def test_the_controller_calls_nothing_outside_the_protocol():
    """Every `group.<name>` the controller's modules use is in the protocol."""
    import pathlib
    import re

    import elastic.controller
    used = set()
    for path in pathlib.Path(elastic.controller.__file__).parent.glob("*.py"):
        text = path.read_text()
        used |= set(re.findall(r"(?<![\w.])group\.([a-z_]+)", text)) | set(re.findall(r"ctl\.group\.([a-z_]+)", text))
    assert sorted(used - set(METHODS) - set(ATTRIBUTES)) == []


def test_messages_read_and_serialise_as_their_words():
    assert RunStatus.DONE == "done" and f"{LostCause.NODE_DIED}" == "node_died"
    report = PollReport(rank=0, generation=1, status=RankStatus.STORAGE_WAIT, step=3)
    assert json.loads(json.dumps({"status": report.status})) == {"status": "storage_wait"}
