"""Every decision has a reason (an invariant, docs/architecture.md): the controller is driven on
the fake group through one fault of each kind (a stopped machine, a killed process, a dead node,
a held Python, a survivor that does not return, a straggler, a shrink and a grow, replacements
that never come, storage trouble, a stalled controller, a lease waited out), and every event
docs/events.md says carries a `reason` must carry a non-empty one; `failure_detected` says why
per lost rank (its `cause` and `detail`). Which kinds carry a reason is read from the table of
docs/events.md, so a kind documented with one later is checked too."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import pytest

from elastic.controller.controller import Controller
from elastic.controller.states import Recovering
from tests.support.fake_group import FakeGroup
from tests.test_controller import _release_leases  # noqa: F401 (an autouse fixture)
from tests.test_controller import _committed_at, drive, kinds, make

pytestmark = pytest.mark.timeout(120)

EVENTS_MD = Path(__file__).resolve().parents[1] / "docs" / "events.md"


def _split_top(text: str, sep: str = " / ") -> list[str]:
    """`text` split at `sep` outside backticks and brackets (a row's per-kind field lists)."""
    parts, cur, depth, tick, i = [], "", 0, False, 0
    while i < len(text):
        ch = text[i]
        tick = not tick if ch == "`" else tick
        if not tick:
            depth += (ch in "([") - (ch in ")]")
            if depth == 0 and text.startswith(sep, i):
                parts.append(cur)
                cur, i = "", i + len(sep)
                continue
        cur += ch
        i += 1
    return [*parts, cur]


def kinds_with_a_reason() -> set[str]:
    """The kinds whose documented fields include `reason`. A row of several kinds (`a` / `b`)
    whose fields split the same way gives each kind its own part; else the row's fields are
    every kind's."""
    out = set()
    for row in EVENTS_MD.read_text().splitlines():
        if not row.startswith("| `"):
            continue
        cells = [c.strip() for c in row.strip().strip("|").split(" | ")]
        names, fields = re.findall(r"`([a-z_]+)`", cells[0]), _split_top(cells[-1])
        per_kind = fields if len(fields) == len(names) else [cells[-1]] * len(names)
        out |= {n for n, f in zip(names, per_kind) if "`reason`" in f}
    return out


# ---------------------------------------------------------------- the faults
def _after_step(n: int, fault: Callable, **make_kw) -> list[dict]:
    c, g, clock = make(**make_kw)
    drive(c, lambda c: c.step >= n)
    fault(c, g, clock)
    drive(c)
    return c.events.events


def stopped_machine(monkeypatch):
    return _after_step(10, lambda c, g, clock: g.freeze(1))


def killed_process(monkeypatch):
    return _after_step(10, lambda c, g, clock: g.kill_process(1))


def dead_node_with_heartbeats(monkeypatch):
    return _after_step(8, lambda c, g, clock: g.kill_node(1), num_steps=30, heartbeats=True,
                       failure={"ping_timeout_s": 5.0})


def refused_heartbeat(monkeypatch):
    return _after_step(8, lambda c, g, clock: g.freeze(1, how="refused"), num_steps=30, step_s=2.5,
                       heartbeats=True, failure={"ping_timeout_s": 5.0})


def held_python_is_a_hang(monkeypatch):
    return _after_step(8, lambda c, g, clock: g.freeze(1, how="held"), num_steps=30, step_s=2.5,
                       heartbeats=True)


def survivor_that_does_not_return(monkeypatch):
    def fault(c, g, clock):
        g.freeze(1, how="held")
        g.freeze(2, how="machine")
        drive(c, lambda c: bool(kinds(c, "worker_replaced")))  # its replacement trains on
    return _after_step(8, fault, num_steps=30, step_s=2.5, heartbeats=True)


def survivor_slow_to_return_and_to_answer(monkeypatch):
    def fault(c, g, clock):
        g.late_returns = {1: 2, 0: 3}
        g.late_polls = {2: 100}
        g.freeze(3 if 3 in g.members else 2, how="machine")
    return _after_step(8, fault, num_steps=30, step_s=2.5, heartbeats=True,
                       scaling={"num_workers": 4})


def member_lost_while_replacements_start(monkeypatch):
    def fault(c, g, clock):
        g.freeze(1)
        drive(c, lambda c: isinstance(c.state, Recovering))
        g.die_on_promote = [2]
    return _after_step(10, fault)


def every_holder_lost_during_the_recovery(monkeypatch):
    def fault(c, g, clock):
        g.freeze(1)
        drive(c, lambda c: isinstance(c.state, Recovering))
        g.die_on_form = [0, 2]
    return _after_step(10, fault)


def straggler_swapped(monkeypatch):
    return _after_step(5, lambda c, g, clock: g.slow_down(1, 20, 4.0), num_steps=60,
                       scaling={"num_spares": 1}, report_compute=True,
                       stragglers={"enabled": True, "window_steps": 5, "consecutive_windows": 2,
                                   "cooldown_s": 0})


def shrink_then_grow(monkeypatch):
    def fault(c, g, clock):
        g.kill_process(1)
        g.fail_promote = 1
    return _after_step(10, fault, num_steps=400,
                       scaling={"min_workers": 2, "shrink_after_s": 1, "grow_check_s": 5})


def grow_waits_for_a_persist(monkeypatch):
    def fault(c, g, clock):
        g.persisting = True
        drive(c, lambda c: bool(kinds(c, "grow_deferred")))
        g.persisting = False
    return _after_step(0, fault, num_steps=400,
                       scaling={"num_workers": 2, "max_workers": 3, "grow_check_s": 1})


def replacements_never_come(monkeypatch):
    def fault(c, g, clock):
        g.freeze(1)
        g.fail_promote = 1
    return _after_step(10, fault)


def storage_failures_and_waits(monkeypatch):
    c, g, clock = make(num_steps=30, final_persist_s={0: 20.0})
    g.retried = [7]
    drive(c)
    events = c.events.events
    c, g, clock = make(num_steps=30, checkpoint={"persist_timeout_s": 10},
                       final_persist_s={r: 1e9 for r in range(3)})
    drive(c)
    return events + c.events.events


def checkpoints_that_do_not_load(monkeypatch):
    _committed_at(monkeypatch, 20)
    c, g, clock = make(num_steps=30, load_failures=["ClientError: 503 Slow Down (request 1)"])
    drive(c)
    return c.events.events


def stalled_controller(monkeypatch):
    return _after_step(5, lambda c, g, clock: clock.advance(9.0))


def resubmitted_driver_waits_out_the_lease(monkeypatch):
    """A first driver renewed 26.6 s ago (ttl 30 s) and stopped; a resubmitted one waits it out."""
    c, _, clock = make(num_steps=10)
    c.lease.take()
    c.lease.renew_once()
    clock.advance(26.6)
    second = Controller(c.job.model_dump_json(), group=FakeGroup(clock), clock=clock, wall=clock)
    drive(second)
    return second.events.events


FAULTS = [stopped_machine, killed_process, dead_node_with_heartbeats, refused_heartbeat,
          held_python_is_a_hang, survivor_that_does_not_return,
          survivor_slow_to_return_and_to_answer, member_lost_while_replacements_start,
          every_holder_lost_during_the_recovery,
          straggler_swapped, shrink_then_grow, grow_waits_for_a_persist, replacements_never_come,
          storage_failures_and_waits, checkpoints_that_do_not_load, stalled_controller,
          resubmitted_driver_waits_out_the_lease]

# What the faults above must reach between them, so that the check below cannot pass by seeing
# nothing: the decisions, the recovery's events and the storage verdicts.
REACHED = {"decision", "failure_detected", "restore_plan", "silence_detected", "hang_detected",
           "worker_replaced", "faults_merged", "resized", "resize_completed", "grow_deferred",
           "checkpoint_retry", "checkpoint_skipped", "storage_wait", "storage_timeout",
           "controller_stalled", "lease_wait"}


def _events_of(fault) -> list[dict]:
    with pytest.MonkeyPatch.context() as mp:  # a fault's patches end with it
        return fault(mp)


def _unexplained(event: dict, reasoned: set[str]) -> str | None:
    """What is missing from `event`'s why, or None."""
    if event["kind"] in reasoned:
        reason = event.get("reason")
        return None if isinstance(reason, str) and reason.strip() else f"reason {reason!r}"
    if event["kind"] == "failure_detected":
        lost = event.get("lost") or []
        bare = [x for x in lost
                if not (str(x.get("cause") or "").strip() and str(x.get("detail") or "").strip())]
        return f"lost ranks without a cause and a detail: {bare or lost}" if bare or not lost \
            else None
    return None


def test_the_docs_table_names_the_kinds_that_carry_a_reason():
    reasoned = kinds_with_a_reason()
    assert {"decision", "restore_plan", "silence_detected", "hang_detected", "worker_replaced",
            "resized"} <= reasoned
    # A row of several kinds gives each its own fields: only worker_replaced of that row has one.
    assert not {"failure_detected", "workers_replaced", "checkpoint_committed",
                "checkpoint_failed"} & reasoned


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.__name__)
def test_every_decision_and_recovery_event_says_why(fault):
    reasoned = kinds_with_a_reason()
    events = _events_of(fault)
    judged = [e for e in events if e["kind"] in reasoned or e["kind"] == "failure_detected"]
    assert judged, f"{fault.__name__} made no decision and no recovery event: it checks nothing"
    missing = [f"{e['kind']} ({why}): {str(e)[:300]}" for e in judged
               if (why := _unexplained(e, reasoned))]
    assert not missing, "events without a reason:\n" + "\n".join(missing)


def test_the_faults_reach_every_kind_of_decision_and_recovery_event():
    seen = {e["kind"] for fault in FAULTS for e in _events_of(fault)}
    assert REACHED <= kinds_with_a_reason() | {"failure_detected"}
    assert not REACHED - seen, f"no fault above reaches {sorted(REACHED - seen)}"
