"""Prometheus metrics (elastic/observability/metrics.py): the event -> metric mapping, the
controller feeding it, the Grafana dashboard's expressions, and a real run on a local multi-node
Ray cluster whose values are read back from the Ray metrics agents' Prometheus endpoints."""
from __future__ import annotations

import contextlib
import json
import logging
import math
from dataclasses import replace
import re
import socket
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from elastic.observability import export as ex
from elastic.observability import metrics as m
from elastic.controller.states import Finished
from elastic.protocol import PollReport, RankStatus

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "elastic.json"


def report(rank: int, **progress) -> PollReport:
    return PollReport(rank=rank, generation=1, status=RankStatus.RUNNING, **progress)


def feed(events, run="r", backend=None):
    rm, be = m.RunMetrics(run), backend or ex.MemoryBackend()
    for ev in events:
        be.apply(rm.event(ev))
    return rm, be


def started(n=3, num_steps=40):
    return [
        {"kind": "run_started", "run": "r", "num_workers": n, "num_steps": num_steps},
        {"kind": "workers_started", "ranks": list(range(n)), "nodes": {}},
        {"kind": "state", "old": "Starting", "new": "Forming"},
        {"kind": "group_formed", "world_size": n, "form_s": 0.1, "generation": 1},
        {"kind": "state", "old": "Forming", "new": "Restoring"},
        {"kind": "restored", "step": 0, "source": "init", "uri": None, "restore_s": 0.1, "world_size": n},
        {"kind": "state", "old": "Restoring", "new": "Running"},
    ]


# ---------------------------------------------------------------------- the catalogue
def test_the_catalogue_is_prefixed_labelled_by_run_and_valid_for_prometheus():
    assert len(m.METRICS) >= 20
    for name, metric in m.METRICS.items():
        assert name.startswith("elastic_") and re.fullmatch(r"[a-z_]+", name), name
        assert metric.tags[0] == "run" and metric.kind in ("gauge", "counter", "histogram")
        assert not name.endswith("_total")  # Ray's exporter adds it to counters
        assert (metric.kind == "histogram") == bool(metric.boundaries)
        assert list(metric.boundaries) == sorted(metric.boundaries) and all(b > 0 for b in metric.boundaries)
    assert m.METRICS["elastic_recoveries"].prometheus_names == ("ray_elastic_recoveries_total",)
    assert m.METRICS["elastic_step"].prometheus_names == ("ray_elastic_step",)
    assert "ray_elastic_recover_seconds_bucket" in m.METRICS["elastic_recover_seconds"].prometheus_names
    assert set(m.PER_RANK) == {n for n, x in m.METRICS.items() if "rank" in x.tags}


# ---------------------------------------------------------------------- events -> metrics
def test_a_recovery_is_counted_by_the_cause_of_its_failure_with_its_detect_and_recover_times():
    events = started() + [
        {"kind": "fault_injected", "action": "kill_process", "rank": 1, "step": 15},
        {"kind": "state", "old": "Running", "new": "Recovering"},
        {"kind": "failure_detected", "lost": [{"rank": 1, "cause": "process_died", "detail": "x"}], "step": 15,
         "detect_s": 0.4},
        {"kind": "decision", "decision": "Restart", "ranks": [1], "reason": "..."},
        {"kind": "workers_replaced", "ranks": [1], "start_s": 0.1, "how": "warm spare", "nodes": {}},
        {"kind": "state", "old": "Recovering", "new": "Forming"},
        {"kind": "group_formed", "world_size": 3, "form_s": 0.1, "generation": 2},
        {"kind": "state", "old": "Forming", "new": "Restoring"},
        {"kind": "restored", "step": 10, "source": "storage", "uri": "u", "restore_s": 0.2, "world_size": 3},
        {"kind": "state", "old": "Restoring", "new": "Running"},
        {"kind": "recovered", "recover_s": 2.5, "detect_s": 0.4, "resumed_step": 10, "fault_step": 15,
         "lost_steps": 5, "world_size": 3},
    ]
    _, be = feed(events)
    assert be.get("elastic_recoveries", cause="process_died") == 1
    assert be.get("elastic_failures", cause="process_died") == 1
    assert be.get("elastic_decisions", decision="Restart") == 1
    assert be.get("elastic_detect_seconds", cause="process_died") == [0.4]
    assert be.get("elastic_recover_seconds", cause="process_died") == [2.5]
    assert be.get("elastic_last_detect_seconds") == 0.4 and be.get("elastic_last_recover_seconds") == 2.5
    assert be.get("elastic_lost_steps") == 5
    assert be.get("elastic_world_size") == 3 and be.get("elastic_num_steps") == 40
    assert be.get("elastic_step") == 10  # back to the restored step
    states = {dict(t)["state"]: v for (name, t), v in be.values.items() if name == "elastic_controller_state"}
    assert set(states) == {"Starting", "Forming", "Restoring", "Running", "Recovering", "Swapping", "Growing",
                           "Dropping", "Trading", "Finished", "Errored"}
    assert [s for s, v in states.items() if v == 1] == ["Running"]
    assert all(dict(t)["run"] == "r" for _, t in be.values)


def test_a_failure_during_a_recovery_belongs_to_the_first_one_and_unknown_fault_times_are_not_detect_times():
    lost = lambda r, c: {"kind": "failure_detected", "lost": [{"rank": r, "cause": c}], "step": 5, "detect_s": None}
    _, be = feed(started() + [lost(1, "node_died"), lost(2, "unresponsive"),
                              {"kind": "recovered", "recover_s": 4.0, "detect_s": 0.0, "resumed_step": 5,
                               "fault_step": 5, "lost_steps": 0, "world_size": 3}])
    assert be.get("elastic_failures", cause="node_died") == 1 and be.get("elastic_failures", cause="unresponsive") == 1
    assert be.get("elastic_recoveries", cause="node_died") == 1
    assert be.get("elastic_recoveries", cause="unresponsive") == 0  # its series exists from the start, at 0
    assert be.get("elastic_detect_seconds", cause="node_died") is None  # no fault time known
    assert be.get("elastic_lost_steps") == 0  # nothing redone: the series stays at its 0


def test_a_user_error_is_a_failure_by_its_own_cause():
    _, be = feed(started() + [
        {"kind": "user_error", "rank": 0, "step": 3, "error": "ValueError: x"},
        {"kind": "failure_detected", "lost": [], "step": 3, "detect_s": None},
        {"kind": "decision", "decision": "Raise", "ranks": [], "reason": "user code error"},
        {"kind": "state", "old": "Recovering", "new": "Errored"},
        {"kind": "run_failed", "step": 3, "loss": None, "error": "...", "checkpoint": None},
    ])
    assert be.get("elastic_failures", cause="user_error") == 1
    assert be.get("elastic_decisions", decision="Raise") == 1
    assert be.get("elastic_controller_state", state="Errored") == 1
    assert be.get("elastic_recoveries", cause="user_error") == 0


@pytest.mark.parametrize("kind,outcome,other", [("run_finished", "finished", "failed"),
                                                ("run_failed", "failed", "finished")])
def test_a_runs_end_is_a_counter_by_its_outcome_at_0_from_the_start(kind, outcome, other):
    # what the run-failed and run-lost alerts read (k8s/monitoring/alerts.yaml): a counter, which
    # Ray's agent serves after the controller is gone, where a gauge lapses within ~20 s
    rm, be = feed(started())
    assert m.METRICS["elastic_runs_ended"].kind == "counter"
    ended = lambda o: be.get("elastic_runs_ended", outcome=o)
    assert ended(outcome) == 0 and ended(other) == 0
    be.apply(rm.event({"kind": kind, "step": 7, "loss": None, "error": None, "checkpoint": None}))
    assert ended(outcome) == 1 and ended(other) == 0
    assert be.get("elastic_step") == 7


def test_checkpoints_by_outcome_and_persist_times():
    _, be = feed(started() + [
        {"kind": "checkpoint_committed", "step": 10, "uri": "u", "persist_s": 0.3, "attempts": 1, "loss": 2.0},
        {"kind": "checkpoint_deferred", "step": 20, "reason": "..."},
        {"kind": "checkpoint_failed", "rank": 0, "step": 30, "error": "..."},
        {"kind": "checkpoint_committed", "step": 40, "uri": "u", "persist_s": 0.5, "attempts": 2, "loss": 1.0},
        {"kind": "checkpoint_committed", "step": 40, "uri": "u", "persist_s": 0.0, "attempts": 0, "loss": 1.0},
        {"kind": "step_skipped", "step": 41, "reason": "non-finite loss"},
        {"kind": "rolled_back", "to_step": 40, "bad_steps": [41]},
    ])
    assert be.get("elastic_checkpoints", outcome="committed") == 3
    assert be.get("elastic_checkpoints", outcome="deferred") == 1
    assert be.get("elastic_checkpoints", outcome="failed") == 1
    assert be.get("elastic_checkpoint_persist_seconds") == [0.3, 0.5]  # a redone step's folder was not written
    assert be.get("elastic_checkpoint_step") == 40 and be.get("elastic_last_persist_seconds") == 0.5
    assert be.get("elastic_skipped_steps") == 1 and be.get("elastic_rollbacks") == 1


def test_progress_gives_step_loss_rates_and_per_rank_times_and_redone_steps_count_again():
    rm, be = feed(started(n=2))
    answers = {r: report(r, step=12, step_s=0.2 + r * 0.05, compute_s=0.1, ckpt_stall_s=0.01 * r) for r in (0, 1)}
    be.apply(rm.progress(12, 2.5, answers))
    assert be.get("elastic_step") == 12 and be.get("elastic_loss") == 2.5 and be.get("elastic_steps") == 12
    assert be.get("elastic_step_seconds", rank=1) == 0.25 and be.get("elastic_compute_seconds", rank=0) == 0.1
    assert be.get("elastic_checkpoint_stall_seconds", rank=1) == 0.01
    assert be.get("elastic_steps_per_second") == pytest.approx(4.0)  # the slowest rank sets the pace
    be.apply(rm.progress(12, 2.5, answers))  # the same step polled again counts nothing
    assert be.get("elastic_steps") == 12
    be.apply(rm.event({"kind": "restored", "step": 10, "source": "storage", "uri": "u", "restore_s": 0.1,
                       "world_size": 2}))
    be.apply(rm.progress(20, 2.0, {}))
    be.apply(rm.event({"kind": "run_finished", "step": 30, "loss": 1.5, "error": None, "checkpoint": "u"}))
    assert be.get("elastic_steps") == 12 + 20  # steps 11 and 12 trained twice
    assert be.get("elastic_step") == 30 and be.get("elastic_loss") == 1.5
    be.apply(rm.progress(30, float("nan"), {}))
    assert be.get("elastic_loss") == 1.5  # a non-finite loss is not a value to plot


def test_each_ranks_memory_is_a_series_and_the_gpu_ones_only_where_there_is_a_gpu():
    from elastic.protocol import MemorySample
    rm, be = feed(started(n=2))
    cpu = MemorySample(rss_bytes=300 << 20, host_limit_bytes=8 << 30)
    gpu = MemorySample(rss_bytes=400 << 20, host_limit_bytes=8 << 30, gpu_allocated_bytes=5 << 30,
                       gpu_reserved_bytes=6 << 30, gpu_peak_allocated_bytes=7 << 30, gpu_total_bytes=80 << 30,
                       gpu_fragmentation=0.125)
    answers = {0: replace(report(0, step=3, step_s=0.1), memory=cpu), 1: replace(report(1, step=3, step_s=0.1),
                                                                                   memory=gpu)}
    be.apply(rm.progress(3, 1.0, answers))
    assert be.get("elastic_rank_rss_bytes", rank=0) == 300 << 20 and be.get("elastic_rank_host_limit_bytes", rank=1) == 8 << 30
    assert be.get("elastic_rank_gpu_reserved_bytes", rank=1) == 6 << 30 and be.get("elastic_rank_gpu_fragmentation", rank=1) == 0.125
    assert be.get("elastic_rank_gpu_total_bytes", rank=1) == 80 << 30
    assert be.get("elastic_rank_gpu_allocated_bytes", rank=0) is None  # no GPU: no series, not a 0
    assert {f"elastic_rank_{f}" for f in m.MEMORY_FIELDS} <= set(m.PER_RANK)  # a shrink ends them too


def test_a_workers_memory_watch_reads_its_own_process_at_most_once_a_second():
    from elastic.runtime.memory_watch import MemoryWatch
    t = [0.0]
    watch = MemoryWatch(clock=lambda: t[0])
    first = watch.sample()
    assert 0 < first.rss_bytes < first.host_limit_bytes and first.gpu_reserved_bytes is None
    held = bytearray(64 << 20)  # touched: resident
    held[::4096] = b"x" * len(held[::4096])
    assert watch.sample() is first  # within the second: the same sample
    t[0] = 1.0
    assert watch.sample().rss_bytes >= first.rss_bytes + (60 << 20)
    del held


def test_series_that_have_not_moved_exist_at_0_and_spares_ready_follows_the_pool():
    rm, be = feed(started(n=2))
    for name in ("elastic_lost_steps", "elastic_skipped_steps", "elastic_rollbacks", "elastic_steps"):
        assert be.get(name) == 0, name
    assert be.get("elastic_spares_ready") == 0
    be.apply(rm.event({"kind": "spares_ready", "num_ready": 1, "wait_s": 1.0}))
    assert be.get("elastic_spares_ready") == 1
    be.apply(rm.progress(4, 1.0, {}, spares_ready=0))  # the spare took a lost rank's place, none refilled
    assert be.get("elastic_spares_ready") == 0


def test_every_label_value_a_counter_can_take_has_its_series_from_the_start():
    from elastic.policies import failure, straggler
    from elastic.protocol import LostCause
    causes = {c.value for c in LostCause} | {"user_error"}
    assert set(m.ZERO_BY_LABEL["elastic_failures"][1]) == causes == set(m.ZERO_BY_LABEL["elastic_recoveries"][1])
    decisions = {cls.__name__ for mod in (failure, straggler) for cls in vars(mod).values()
                 if isinstance(cls, type) and cls.__module__ == mod.__name__ and hasattr(cls, "__dataclass_fields__")
                 and cls.__name__ in ("Restart", "Raise", "Swap", "Report", "Drop")} | {"Grow"}
    assert decisions <= set(m.ZERO_BY_LABEL["elastic_decisions"][1])
    _, be = feed(started(n=2))
    for name, (tag, values) in m.ZERO_BY_LABEL.items():
        assert all(be.get(name, **{tag: v}) == 0 for v in values), name


def test_a_shrink_ends_the_series_of_the_ranks_that_are_gone():
    rm, be = feed(started(n=3))
    be.apply(rm.progress(5, 1.0, {r: report(r, step=5, step_s=0.1, compute_s=0.05) for r in range(3)}))
    be.apply(rm.window({0: 1.0, 1: 1.0, 2: 2.0}))
    be.apply(rm.event({"kind": "resized", "old_world_size": 3, "new_world_size": 2, "path": "memory", "reason": "x",
                       "decide_s": 0.1}))
    assert be.get("elastic_world_size") == 2
    # NaN: Ray's exporter leaves such a series out of the scrape (a gap in Grafana).
    assert math.isnan(be.get("elastic_step_seconds", rank=2)) and math.isnan(be.get("elastic_straggler_ratio", rank=2))
    assert be.get("elastic_step_seconds", rank=1) == 0.1


def test_straggler_ratios_come_from_every_window_and_from_slow_window_events():
    rm, be = feed(started(n=3))
    be.apply(rm.event({"kind": "slow_window", "step": 10, "ratios": {"0": 1.0, "1": 2.4, "2": 0.9},
                       "consecutive": {"1": 1}}))
    assert be.get("elastic_straggler_ratio", rank=1) == 2.4
    be.apply(rm.window({0: 1.0, 1: 1.05, 2: 0.95}))  # a healthy window: not an event, still a value
    assert be.get("elastic_straggler_ratio", rank=1) == 1.05


def test_an_unknown_event_kind_maps_to_nothing():
    assert m.RunMetrics("r").event({"kind": "something_new", "x": 1}) == []


class _Broken:
    def apply(self, updates):
        list(updates)
        raise RuntimeError("metrics agent gone")


def test_a_failing_backend_never_breaks_the_caller_and_is_logged_once(caplog):
    hook = ex.MetricsHook("r", _Broken(), clock=lambda: 0.0)
    with caplog.at_level(logging.WARNING, logger="elastic.observability.export"):
        for ev in started():
            hook.on_event(ev)
        hook.on_progress(3, 1.0, {0: report(0, step=3, step_s=0.1)})
        hook.on_window({0: 1.0})
        hook.on_event({"kind": "failure_detected", "lost": "not a list of dicts", "step": 1})  # a bad event too
    assert len([r for r in caplog.records if "metrics not updated" in r.message]) == 1


def test_progress_is_exported_at_most_once_a_second():
    t = [0.0]
    be = ex.MemoryBackend()
    hook = ex.MetricsHook("r", be, clock=lambda: t[0])
    hook.on_progress(1, 1.0, {})
    t[0] = 0.5
    hook.on_progress(2, 1.0, {})
    assert be.get("elastic_step") == 1
    t[0] = 1.0
    hook.on_progress(3, 1.0, {})
    assert be.get("elastic_step") == 3


def test_ray_backend_sets_again_the_gauges_that_have_not_moved():
    """Ray's agent drops a gauge series not set for ~20 s: a run's num_steps, set once, would
    vanish from the scrape mid-run. Each series not set for refresh_s is set again, to its last
    value; a series ended with NaN (a rank gone after a shrink) is left to lapse."""
    sets = []

    class Recorder:  # stands for a ray.util.metrics object
        def __init__(self, name):
            self.name = name

        def set(self, value, tags):
            sets.append(((self.name, tags.get("rank")), value))

        def inc(self, value, tags):
            pass

        _record = observe = inc

    t = [0.0]
    be = ex.RayBackend(refresh_s=5.0, clock=lambda: t[0], metrics={c.name: Recorder(c.name) for c in m.CATALOGUE})
    rm = m.RunMetrics("r")
    be.apply(rm.event({"kind": "run_started", "num_steps": 30}) + rm.event({"kind": "workers_started", "ranks": [0, 1]}))
    be.apply(rm.progress(4, 1.0, {0: report(0, step=4, step_s=0.1), 1: report(1, step=4, step_s=0.2)}))
    t[0] = 4.9
    sets.clear()
    assert be.refresh() == 0 and sets == []
    be.apply([rm._u("elastic_step", 5)])  # moved at 4.9: due at 9.9
    t[0] = 5.0
    be.apply(rm.event({"kind": "resized", "new_world_size": 1}))  # rank 1's series end (NaN); world size set
    t[0] = 6.0
    sets.clear()
    assert be.refresh() == len(sets) > 0
    again = dict(sets)
    assert again[("elastic_num_steps", None)] == 30 and again[("elastic_step_seconds", "0")] == 0.1
    assert ("elastic_step", None) not in again and ("elastic_world_size", None) not in again
    assert not [k for k in again if k[1] == "1"]  # rank 1's series ended: not brought back
    t[0] = 9.9
    sets.clear()
    assert be.refresh() == 1 and dict(sets) == {("elastic_step", None): 5}
    t[0] = 10.0
    sets.clear()
    be.refresh()
    assert dict(sets) == {("elastic_world_size", None): 1}  # set at 5.0 by the resize
    t[0] = 11.0
    assert be.refresh() > 0 and ("elastic_num_steps", None) in dict(sets)  # refreshed at 6.0


def test_gauges_are_set_again_at_half_the_export_interval_so_none_lapses_between_two_exports():
    # Ray's agent drops a gauge two export intervals after it last got it: 2 s where
    # RAY_metrics_report_interval_ms=1000 reaches every process; a 5 s refresh left 3 s gaps
    assert ex.gauge_refresh_s(10_000) == ex.GAUGE_REFRESH_S == 5.0  # Ray's default interval
    assert ex.gauge_refresh_s(60_000) == 5.0
    assert ex.gauge_refresh_s(1000) == 0.5
    assert ex.gauge_refresh_s(100) == 0.5  # Ray exports once a second at most


def test_without_ray_there_is_no_backend_and_nothing_to_do(monkeypatch):
    monkeypatch.setattr("ray.is_initialized", lambda: False)
    hook = ex.for_run("r")
    assert hook.backend is None
    hook.on_event({"kind": "run_started", "num_steps": 3})  # no-op


# ---------------------------------------------------------------------- the controller feeds it
def test_the_controller_derives_metrics_from_its_events_and_polls(monkeypatch):
    from tests.test_controller import drive, make

    backend = ex.MemoryBackend()
    monkeypatch.setattr(ex, "_default_backend", lambda: backend)
    c, g, _ = make(num_steps=40)
    drive(c, lambda c: c.step >= 10)
    g.freeze(1)
    drive(c)
    assert isinstance(c.state, Finished)
    assert backend.get("elastic_step", run="ctl") == 40  # (run_started, with num_steps, comes from run())
    assert backend.get("elastic_world_size") == 3
    assert backend.get("elastic_controller_state", state="Finished") == 1
    assert backend.get("elastic_controller_state", state="Running") == 0
    # the run-lost alert's heartbeat: the run_started event's wall time
    (started,) = [e for e in c.events.events if e["kind"] == "run_started"]
    assert backend.get("elastic_start_time_seconds") == started["t"] > 0
    (fd,) = [e for e in c.events.events if e["kind"] == "failure_detected"]
    cause = fd["lost"][0]["cause"]
    assert backend.get("elastic_recoveries", cause=cause) == 1 and backend.get("elastic_failures", cause=cause) == 1
    (rec,) = [e for e in c.events.events if e["kind"] == "recovered"]
    assert backend.get("elastic_recover_seconds", cause=cause) == [pytest.approx(rec["recover_s"])]
    assert backend.get("elastic_steps") == 40 + rec["lost_steps"]
    assert backend.get("elastic_step_seconds", rank=0) == g.step_s and backend.get("elastic_loss") == 1.0


# ---------------------------------------------------------------------- the Grafana dashboard
def _exprs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("expr", "definition") and isinstance(v, str):
                yield v
            elif k == "query" and isinstance(v, str) and "(" in v:
                yield v
            else:
                yield from _exprs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _exprs(v)


def test_the_grafana_dashboard_loads_and_queries_only_metrics_we_define():
    dash = json.loads(DASHBOARD.read_text())
    exprs = list(_exprs(dash))
    assert exprs
    defined = {n for metric in m.METRICS.values() for n in metric.prometheus_names}
    used = {name for e in exprs for name in re.findall(r"\bray_elastic_\w+", e)}
    assert used <= defined, f"the dashboard queries metrics we do not define: {sorted(used - defined)}"
    # Every metric has a panel.
    assert {n for n, metric in m.METRICS.items() if not set(metric.prometheus_names) & used} == set()
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    assert all(p["title"] and p["targets"] and p["datasource"]["uid"] == "${datasource}" for p in panels)
    assert all('run=~"$run"' in t["expr"] for p in panels for t in p["targets"])
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "cluster", "run"}
    assert all('ray_io_cluster=~"$cluster"' in t["expr"] for p in panels for t in p["targets"])
    # a counter's total over the dashboard's range: increase(), so a resubmitted cluster's restart at 0
    # is not a drop, never the raw value
    raw = [t["expr"] for p in panels for t in p["targets"]
           if re.search(r"_total\{", t["expr"]) and not re.search(r"(increase|rate)\(ray_elastic_\w+_total\{", t["expr"])]
    assert raw == []
    (quantiles,) = [p for p in panels if p["title"].startswith("Detect and recover")]
    assert sorted(t["legendFormat"] for t in quantiles["targets"]) == ["p50 detect", "p50 recover", "p90 detect",
                                                                         "p90 recover"]


# ---------------------------------------------------------------------- a real Prometheus and promtool
ALERTS = Path(__file__).resolve().parent.parent / "k8s" / "monitoring" / "alerts.yaml"
GRAFANA_VARS = {"$__rate_interval": "1m", "$__range": "10m", "$__interval": "1s"}


def _panel_exprs(run: str) -> list[str]:
    """Every panel query of the dashboard as Prometheus gets it from Grafana: its variables filled in."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            e = t["expr"].replace('run=~"$run"', f'run=~"{run}"').replace('"$cluster"', '".*"')
            for var, value in GRAFANA_VARS.items():
                e = e.replace(var, value)
            out.append(e)
    return out


def _alert_rules() -> list[dict]:
    import yaml
    (doc,) = [d for d in yaml.safe_load_all(ALERTS.read_text()) if d]
    return [r for g in doc["spec"]["groups"] for r in g["rules"]]


LOST_FOR = "3s"  # ElasticRunLost's `for:` here (5 m in the file: tests/test_alerts.py checks that)


def _loaded_rule_groups() -> list[dict]:
    """The PrometheusRule's groups as the real Prometheus below loads them: unchanged, but for
    ElasticRunLost's `for:`, so that a drill sees it fire."""
    import yaml
    (doc,) = [d for d in yaml.safe_load_all(ALERTS.read_text()) if d]
    groups = doc["spec"]["groups"]
    (lost,) = [r for g in groups for r in g["rules"] if r["alert"] == "ElasticRunLost"]
    lost["for"] = LOST_FOR
    return groups


@pytest.fixture(scope="module")
def prometheus():
    from tests.support.prometheus import HOW, find_prometheus, prometheus_server
    if find_prometheus() is None:
        pytest.skip(f"no prometheus binary: {HOW}")
    with prometheus_server(rule_groups=_loaded_rule_groups()) as server:
        yield server


def test_the_alert_rules_pass_promtool_and_every_query_parses_in_prometheus(prometheus, tmp_path):
    import subprocess
    import yaml
    (doc,) = [d for d in yaml.safe_load_all(ALERTS.read_text()) if d]
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump({"groups": doc["spec"]["groups"]}))  # a PrometheusRule's spec is a rules file
    out = subprocess.run([prometheus.promtool, "check", "rules", str(rules_file)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and f"SUCCESS: {len(_alert_rules())} rules found" in out.stdout, out.stdout + out.stderr
    # A query Prometheus cannot parse is refused with an error: none is.
    for e in _panel_exprs("nothing-yet") + [r["expr"] for r in _alert_rules()]:
        assert prometheus.query(e) == [], e  # parsed and evaluated: no data yet
    with pytest.raises(ValueError, match="bad_data"):  # the check can fail
        prometheus.query("max by (run (ray_elastic_step)")


# ---------------------------------------------------------------------- a real run, read back from Prometheus
NUM_STEPS, FAULT_STEP, NUM_WORKERS = 30, 15, 2
REPORT_INTERVAL_MS = 1000  # Ray's default is 10 s; the export cadence never goes below 1 s


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def metrics_cluster():
    """Head (no CPUs, its metrics agent on a fixed free port) + 3 one-CPU worker nodes, every
    process reporting its metrics to its node's agent once a second."""
    import ray
    from ray.cluster_utils import Cluster

    from elastic.local_cluster import LocalCluster

    port = _free_port()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "metrics_export_port": port,
        "_system_config": {"metrics_report_interval_ms": REPORT_INTERVAL_MS}})
    handle = LocalCluster(cluster, cpus_per_node=1)
    try:
        for _ in range(NUM_WORKERS + 1):
            cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, logging_level=logging.WARNING)
        handle._wait_registered(120)
        yield handle, port
    finally:
        handle.shutdown()


def _targets() -> list[str]:
    """Every live node's metrics agent: what Ray's service discovery file lists for Prometheus."""
    import ray

    return [f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}" for n in ray.nodes() if n["Alive"]]


def _scrape(targets: list[str], run: str) -> dict[tuple[str, tuple], float]:
    """Our run's `ray_elastic_*` samples from every target: (name, our labels) -> value (summed
    over Ray's own labels, e.g. WorkerId, as a `sum by` in PromQL would)."""
    from prometheus_client.parser import text_string_to_metric_families

    ours = {"run", "rank", "cause", "state", "decision", "outcome", "le"}
    out: dict[tuple[str, tuple], float] = {}
    for target in targets:
        try:
            body = urllib.request.urlopen(f"http://{target}/metrics", timeout=5).read().decode()
        except OSError:
            continue  # an agent starting or gone: the next scrape tries again
        for family in text_string_to_metric_families(body):
            for s in family.samples:
                if s.name.startswith("ray_elastic_") and s.labels.get("run") == run:
                    key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k in ours and k != "run")))
                    out[key] = out.get(key, 0.0) + s.value
    return out


@pytest.mark.chaos
@pytest.mark.timeout(300)
def test_a_real_run_s_metrics_are_read_from_the_prometheus_endpoint(metrics_cluster, prometheus, tmp_path):
    from elastic import Trainer

    cluster, head_port = metrics_cluster
    prometheus.set_targets(_targets())  # every node's agent, scraped every second during the drill
    t_start = time.time()
    run = f"metrics-{uuid.uuid4().hex[:8]}"
    job = {
        "run": {"name": run, "num_steps": NUM_STEPS, "seed": 7},
        "scaling": {"num_workers": NUM_WORKERS},
        "failure": {"max_failures": 2, "hang_floor_s": 5},
        "checkpoint": {"storage_uri": str(tmp_path / "runs"), "every_steps": 10},
        "train": {"model": "elastic.workload:build_model", "dataset": "elastic.workload:build_dataset",
                  "loss": "elastic.workload:loss_fn", "global_batch_size": 48},
        "chaos": [{"action": "kill_process", "rank": 1, "at_step": FAULT_STEP}],
    }
    result = Trainer(job).fit(progress=False)
    t_end = time.time()
    assert result.metrics["step"] == NUM_STEPS
    targets = _targets()
    assert any(t.endswith(f":{head_port}") for t in targets)  # the head's agent, where the controller runs
    (fd,) = result.events_of("failure_detected")
    cause = "+".join(sorted({x["cause"] for x in fd["lost"]}))
    (rec,) = result.events_of("recovered")
    committed = result.events_of("checkpoint_committed")
    want = {
        ("ray_elastic_step", ()): NUM_STEPS,
        ("ray_elastic_num_steps", ()): NUM_STEPS,
        ("ray_elastic_world_size", ()): NUM_WORKERS,
        ("ray_elastic_controller_state", (("state", "Finished"),)): 1,
        ("ray_elastic_controller_state", (("state", "Recovering"),)): 0,
        ("ray_elastic_failures_total", (("cause", cause),)): 1,
        ("ray_elastic_recoveries_total", (("cause", cause),)): 1,
        ("ray_elastic_decisions_total", (("decision", "Restart"),)): 1,
        ("ray_elastic_recover_seconds_count", (("cause", cause),)): 1,
        ("ray_elastic_steps_total", ()): NUM_STEPS + rec["lost_steps"],
        ("ray_elastic_checkpoint_step", ()): max(e["step"] for e in committed),
        ("ray_elastic_checkpoints_total", (("outcome", "committed"),)): len(committed),
        # series that never moved in this run exist, at 0 (rate() and alerts see a 0, not nothing)
        ("ray_elastic_lost_steps_total", ()): rec["lost_steps"],
        ("ray_elastic_skipped_steps_total", ()): 0,
        ("ray_elastic_rollbacks_total", ()): 0,
        ("ray_elastic_spares_ready", ()): 0,
        # the last step's loss: a gauge exported as asynchronously as the counters
        ("ray_elastic_loss", ()): result.metrics["loss"],
    }
    # Export is asynchronous (each process reports every REPORT_INTERVAL_MS): poll, never time.
    deadline = time.monotonic() + 60
    while True:
        got = _scrape(targets, run)
        missing = {k: (v, got.get(k)) for k, v in want.items() if got.get(k) != pytest.approx(v)}
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not missing, f"(wanted, scraped): {missing}"
    # Exact times in the gauges; a histogram's sum is rebuilt by Ray from bucket midpoints.
    assert got[("ray_elastic_last_recover_seconds", ())] == pytest.approx(rec["recover_s"])
    assert got[("ray_elastic_recover_seconds_sum", (("cause", cause),))] > 0
    if fd["detect_s"] is not None:  # an injected fault: its time is known
        assert got[("ray_elastic_detect_seconds_count", (("cause", cause),))] == 1
        assert got[("ray_elastic_last_detect_seconds", ())] == pytest.approx(fd["detect_s"])
    assert got[("ray_elastic_steps_per_second", ())] > 0
    assert all(got.get(("ray_elastic_step_seconds", (("rank", str(r)),)), 0) > 0 for r in range(NUM_WORKERS))
    assert all(got.get(("ray_elastic_compute_seconds", (("rank", str(r)),)), 0) > 0 for r in range(NUM_WORKERS))
    for r in range(NUM_WORKERS):  # each worker's memory; no GPU here, so no GPU series at all
        rss = got.get(("ray_elastic_rank_rss_bytes", (("rank", str(r)),)), 0)
        assert 50 << 20 < rss < got[("ray_elastic_rank_host_limit_bytes", (("rank", str(r)),))]
    assert not [k for k in got if k[0].startswith("ray_elastic_rank_gpu_")]
    persisted = [e["persist_s"] for e in committed if e["attempts"]]
    assert got[("ray_elastic_checkpoint_persist_seconds_count", ())] == len(persisted)
    assert got[("ray_elastic_last_persist_seconds", ())] == pytest.approx(persisted[-1])
    _read_back_from_prometheus(prometheus, run, result, t_start, t_end, cause)


def _read_back_from_prometheus(prom, run: str, result, t_start: float, t_end: float, cause: str) -> None:
    """What the dashboard and the alerts see, through a real Prometheus that scraped the drill."""
    deadline = time.monotonic() + 60
    while True:  # the last export reaches the agents within a second, the next scrape a second later
        got = prom.query(f'max by (run) (ray_elastic_step{{run="{run}"}})')
        if (got and float(got[0]["value"][1]) == NUM_STEPS) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert got and float(got[0]["value"][1]) == NUM_STEPS, got
    time.sleep(2)  # a range's last evaluation, on its 1 s grid, falls after that newest sample
    now = time.time()
    # steps advanced while it was scraped: never back, and up from where they were first seen (a
    # 30-step run outpaces the 1 s export and scrape, so only a few of its steps are seen)
    (series,) = prom.query_range(f'max by (run) (ray_elastic_step{{run="{run}"}})', t_start, now)
    steps = [float(v) for _, v in series["values"]]
    assert steps == sorted(steps) and steps[0] < steps[-1] == NUM_STEPS, steps
    # a gauge set once, at the start, is still served when the run ends (Ray's agent drops a series
    # not set for ~20 s, for good if its value never changes; the controller sets each again every
    # export.GAUGE_REFRESH_S). A failed scrape may leave a gap; the series comes back at the next.
    (ns,) = prom.query_range(f'max by (run) (ray_elastic_num_steps{{run="{run}"}})', t_start, now)
    at = [float(t) for t, _ in ns["values"]]
    assert at[-1] >= t_end, (at, t_end)
    # the recovery, counted by its cause
    (rec,) = prom.query(f'sum by (cause) (ray_elastic_recoveries_total{{run="{run}"}}) > 0')
    assert rec["metric"]["cause"] == cause and float(rec["value"][1]) == 1
    zeros = prom.query(f'sum by (cause) (ray_elastic_recoveries_total{{run="{run}"}}) == 0')
    assert len(zeros) == len(m.ZERO_BY_LABEL["elastic_recoveries"][1]) - 1  # every other cause, at 0
    # the checkpoint step moves with the commits (what the staleness alert watches): only committed
    # steps, ending at the last one, and as many changes as distinct values seen
    (ck,) = prom.query_range(f'max by (run) (ray_elastic_checkpoint_step{{run="{run}"}})', t_start, now)
    seen = [float(v) for _, v in ck["values"]]
    committed = [e["step"] for e in result.events_of("checkpoint_committed")]
    assert seen == sorted(seen) and set(seen) <= set(committed) and seen[-1] == max(committed), (seen, committed)
    (changes,) = prom.query(f'max by (run) (changes(ray_elastic_checkpoint_step{{run="{run}"}}[10m]))')
    assert float(changes["value"][1]) >= len(set(seen)) - 1
    # each rank's memory
    rss = prom.query(f'max by (run, rank) (ray_elastic_rank_rss_bytes{{run="{run}"}})')
    assert sorted(int(x["metric"]["rank"]) for x in rss) == list(range(NUM_WORKERS))
    # every panel's query evaluates on the real data; the run finished well, so no alert fires
    answered = [e for e in _panel_exprs(run) if prom.query(e)]
    assert len(answered) >= len(_panel_exprs(run)) // 2, "most panels show this run"
    _fires_nothing(prom, run, t_start)


def _fires_nothing(prom, run: str, t_start: float) -> None:
    """The run finished well (a recovery on the way): once its gauges have left the scrape and
    ElasticRunLost's `for:` is over, no alert of the loaded rules ever fired on it, and the
    run-failed and run-lost ones were never even pending. Every rule evaluated without error."""
    from tests.support.prometheus import wait_for
    heartbeat = f'ray_elastic_start_time_seconds{{run="{run}"}}'
    gone = wait_for(lambda: not prom.query(heartbeat), timeout_s=60)
    assert gone, "the run's gauges should lapse once its controller is gone"
    (ended,) = prom.query(f'sum by (outcome) (ray_elastic_runs_ended_total{{run="{run}"}}) > 0')
    assert ended["metric"]["outcome"] == "finished"  # what tells the lost alert the run ended
    time.sleep(float(LOST_FOR.rstrip("s")) + 3)  # past ElasticRunLost's `for:` (evaluated each 1 s)
    rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
    assert {r["name"] for r in rules} == {r["alert"] for r in _alert_rules()}
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    fired = prom.query_range(f'ALERTS{{run="{run}", alertstate="firing"}}', t_start, time.time())
    assert fired == [], fired
    ours = "ElasticRunFailed|ElasticRunLost"
    pending = prom.query_range(f'ALERTS{{run="{run}", alertname=~"{ours}"}}', t_start, time.time())
    assert pending == [], pending


def _fit_failing(job: dict):
    from elastic import Trainer
    from elastic.trainer import TrainingFailed
    with pytest.raises(TrainingFailed) as failed:
        Trainer(job).fit(progress=False)
    return failed.value


def _controller_pid() -> int:
    """The pid of the one live controller actor of this cluster (the run in flight)."""
    from ray._private.state import actors
    alive = actors(actor_state_name="ALIVE").values()
    (pid,) = [a["Pid"] for a in alive if a["ActorClassName"] == "Controller"]
    return pid


@pytest.mark.chaos
@pytest.mark.timeout(300)
def test_a_failed_run_and_a_lost_run_fire_their_alerts_in_a_real_prometheus(
        metrics_cluster, prometheus, tmp_path):
    """The alerts a platform team relies on, in a Prometheus loaded with k8s/'s rules, scraping
    the cluster's agents: a run whose controller is killed mid-run (as the OOM killer or a lost
    head would) fires ElasticRunLost; a run that fails fires ElasticRunFailed; neither fires the
    other's alert. The failed run trains while the lost one's gauges lapse (~20 s)."""
    import os
    import signal
    import threading

    from tests.support.prometheus import alert_states, wait_for

    prometheus.set_targets(_targets())
    t_start = time.time()

    def job(run: str, **over) -> dict:
        return {"run": {"name": run, "num_steps": 400, "seed": 7},
                "scaling": {"num_workers": NUM_WORKERS},
                "checkpoint": {"storage_uri": str(tmp_path / "runs"), "every_steps": 50},
                "train": {"model": "elastic.workload:build_model",
                          "dataset": "elastic.workload:build_dataset",
                          "loss": "elastic.workload:loss_fn", "global_batch_size": 48}, **over}

    lost = f"lost-{uuid.uuid4().hex[:8]}"  # its controller killed once Prometheus has seen it train
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(error=_fit_failing(job(lost))),
                              daemon=True)
    runner.start()
    training = f'ray_elastic_step{{run="{lost}"}} >= 2'
    seen = wait_for(lambda: prometheus.query(training), timeout_s=120)
    assert seen, "the run should train, and be scraped, before its controller is killed"
    os.kill(_controller_pid(), signal.SIGKILL)
    runner.join(timeout=60)
    assert "the controller actor died" in str(outcome.get("error")), outcome

    failed = f"failed-{uuid.uuid4().hex[:8]}"  # no failure allowed, a worker killed at step 3
    error = _fit_failing(job(failed, failure={"max_failures": 0},
                             chaos=[{"action": "kill_process", "rank": 1, "at_step": 3}]))
    assert "max_failures=0" in str(error)
    fires = lambda alert, run: alert_states(prometheus, alert, run) == {"firing"}
    assert wait_for(lambda: fires("ElasticRunFailed", failed), timeout_s=60), \
        alert_states(prometheus, "ElasticRunFailed", failed)
    assert wait_for(lambda: fires("ElasticRunLost", lost), timeout_s=90), \
        alert_states(prometheus, "ElasticRunLost", lost)
    # each run fired its own alert only
    other = prometheus.query_range(f'ALERTS{{alertname="ElasticRunLost", run="{failed}"}} or '
                                   f'ALERTS{{alertname="ElasticRunFailed", run="{lost}"}}',
                                   t_start, time.time())
    assert other == [], other
