"""Where a run's metric updates go (elastic/observability/metrics.py makes them): a backend that
applies them (`RayBackend`: `ray.util.metrics` objects in the controller actor, exported by its
node's Ray metrics agent; `MemoryBackend`: kept in memory, for tests and runs without Ray), and
`MetricsHook`, what the controller holds. Metrics are best effort: no update may raise into the
controller; a failing backend is logged once and the run goes on without it.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable, Iterable, Protocol

from elastic.observability.metrics import CATALOGUE, PROGRESS_EVERY_S, RunMetrics, Update

log = logging.getLogger(__name__)


class Backend(Protocol):
    def apply(self, updates: Iterable[Update]) -> None: ...


class MemoryBackend:
    """Keeps what Prometheus would show, by (metric, tags): a gauge's last value, a counter's
    total, a histogram's observations. For tests and for looking at a run without Ray."""

    def __init__(self):
        self.values: dict[tuple[str, tuple], Any] = {}

    def apply(self, updates: Iterable[Update]) -> None:
        for u in updates:
            key = (u.metric, u.tags)
            if u.op == "set":
                self.values[key] = u.value
            elif u.op == "inc":
                self.values[key] = self.values.get(key, 0.0) + u.value
            else:
                self.values.setdefault(key, []).append(u.value)

    def get(self, metric: str, **tags: Any) -> Any:
        """The value of the one series of `metric` whose tags include `tags` (None if there is none)."""
        want = {k: str(v) for k, v in tags.items()}
        found = [v for (m, t), v in self.values.items() if m == metric and want.items() <= dict(t).items()]
        assert len(found) <= 1, f"{metric} {tags}: {len(found)} series match"
        return found[0] if found else None


def _ray_metrics() -> dict[str, Any]:
    from ray.util.metrics import Counter, Gauge, Histogram

    out: dict[str, Any] = {}
    for m in CATALOGUE:
        if m.kind == "gauge":
            out[m.name] = Gauge(m.name, m.description, tag_keys=m.tags)
        elif m.kind == "counter":
            out[m.name] = Counter(m.name, m.description, tag_keys=m.tags)
        else:
            out[m.name] = Histogram(m.name, m.description, boundaries=list(m.boundaries), tag_keys=m.tags)
    return out


# Ray's metrics agent stops serving a gauge series it has not received for two export intervals,
# whether or not its process still lives (set again to the same value, a series stays): 2 x
# max(metrics_report_interval_ms, 1 s) as the agent's process sees the interval, so 20-30 s at
# the default 10 s, and 2 s where RAY_metrics_report_interval_ms=1000 reaches every process
# (measured with Ray 2.60; `_system_config` at ray.init does not reach the agent: 20 s there).
# A run's series that rarely move (num_steps, world_size, the controller's state, the checkpoint
# step) would vanish mid-run; each is set again at half the export interval, at most this period.
# Counters are never dropped: the agent serves them for as long as it lives.
GAUGE_REFRESH_S = 5.0


def gauge_refresh_s(report_interval_ms: float) -> float:
    """How often to set each gauge again for an export every `report_interval_ms`: half the
    interval Ray exports at (never below 1 s), at most `GAUGE_REFRESH_S`."""
    return min(GAUGE_REFRESH_S, max(report_interval_ms, 1000.0) / 1000.0 / 2)


class RayBackend:
    """`ray.util.metrics` objects, one per catalogue entry, created in the calling process (the
    controller actor); Ray's metrics agent on its node exports them. Once started, a thread sets
    again every gauge series not set for `refresh_s` (`GAUGE_REFRESH_S`), so that it stays in
    the scrape for as long as the controller lives."""

    def __init__(self, refresh_s: float = GAUGE_REFRESH_S, clock: Callable[[], float] = time.monotonic,
                 metrics: dict[str, Any] | None = None):
        self._metrics = _ray_metrics() if metrics is None else metrics  # by catalogue name
        self.refresh_s, self._clock = refresh_s, clock
        self._gauges: dict[tuple[str, tuple], tuple[float, float]] = {}  # series -> (value, when set)
        self._lock = threading.Lock()

    def start(self) -> "RayBackend":
        """Start the thread that refreshes the gauges (`refresh`, every `refresh_s`)."""
        threading.Thread(target=self._keep_alive, name="elastic-metrics-refresh", daemon=True).start()
        return self

    def apply(self, updates: Iterable[Update]) -> None:
        now = self._clock()
        with self._lock:
            for u in updates:
                metric = self._metrics[u.metric]
                if u.op == "set":
                    metric.set(u.value, tags=u.tag_dict)
                    if math.isnan(u.value):  # a series ended (a rank gone after a shrink): let it lapse
                        self._gauges.pop((u.metric, u.tags), None)
                    else:
                        self._gauges[(u.metric, u.tags)] = (u.value, now)
                elif u.op == "inc":
                    if u.value > 0:
                        metric.inc(u.value, tags=u.tag_dict)
                    elif u.value == 0:
                        # A counter's series at 0 (ZERO_AT_START): Ray's inc() refuses 0, its record does not.
                        metric._record(0.0, tags=u.tag_dict)
                else:
                    metric.observe(u.value, tags=u.tag_dict)

    def refresh(self) -> int:
        """Set again, to the same value, every gauge series last set `refresh_s` ago or more;
        how many were."""
        now = self._clock()
        with self._lock:
            stale = [(key, value) for key, (value, at) in self._gauges.items() if now - at >= self.refresh_s]
            for (name, tags), value in stale:
                self._metrics[name].set(value, tags=dict(tags))
                self._gauges[(name, tags)] = (value, now)
        return len(stale)

    def _keep_alive(self) -> None:
        while True:
            time.sleep(self.refresh_s)
            try:
                self.refresh()
            except Exception as e:  # noqa: BLE001 - metrics are best effort; the controller must go on
                log.warning("gauges no longer refreshed: %s: %s", type(e).__name__, e)
                return


def _default_backend() -> Backend | None:
    """Ray's metrics inside a Ray process; nothing elsewhere (the controller driven by tests)."""
    import ray

    if not ray.is_initialized():
        return None
    return RayBackend(refresh_s=gauge_refresh_s(ray._config.metrics_report_interval_ms())).start()


class MetricsHook:
    """What the controller holds: `on_event` (the event log's echo), `on_progress` and
    `on_window`. Thread-safe (events come from the controller's RPC threads too); never raises."""

    def __init__(self, run: str, backend: Backend | None, clock: Callable[[], float] = time.monotonic):
        self.mapping = RunMetrics(run)
        self.backend = backend
        self._clock = clock
        self._lock = threading.Lock()
        self._progress_at: float | None = None
        self._warned = False

    def _apply(self, make: Callable[[], list[Update]]) -> None:
        if self.backend is None:
            return
        try:
            with self._lock:
                self.backend.apply(make())
        except Exception as e:  # noqa: BLE001 - metrics are best effort; the run must go on
            if not self._warned:
                self._warned = True
                log.warning("metrics not updated (further failures are not logged): %s: %s", type(e).__name__, e)

    def on_event(self, ev: dict) -> None:
        self._apply(lambda: self.mapping.event(ev))

    def on_progress(self, step: int, loss: float | None, answers: dict, spares_ready: int | None = None) -> None:
        if self.backend is None:
            return
        # Gauges at most once a second (Ray exports no faster); the steps counter on every poll.
        now = self._clock()
        if self._progress_at is None or now - self._progress_at >= PROGRESS_EVERY_S:
            self._progress_at = now
            self._apply(lambda: self.mapping.progress(step, loss, answers, spares_ready))
        else:
            self._apply(lambda: self.mapping.steps(step))

    def on_window(self, ratios: dict) -> None:
        self._apply(lambda: self.mapping.window(ratios))


def for_run(run: str, clock: Callable[[], float] = time.monotonic) -> MetricsHook:
    """The controller's hook: exporting through Ray when it runs in a Ray process."""
    try:
        backend = _default_backend()
    except Exception as e:  # noqa: BLE001 - a run without metrics is still a run
        log.warning("metrics disabled: %s: %s", type(e).__name__, e)
        backend = None
    return MetricsHook(run, backend, clock)
