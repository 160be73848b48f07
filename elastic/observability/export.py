"""Where a run's metric updates go (elastic/observability/metrics.py makes them): a backend that
applies them (`RayBackend`: `ray.util.metrics` objects in the controller actor, exported by its
node's Ray metrics agent; `MemoryBackend`: kept in memory, for tests and runs without Ray), and
`MetricsHook`, what the controller holds. Metrics are best effort: no update may raise into the
controller; a failing backend is logged once and the run goes on without it.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable, Protocol

from elastic.observability.metrics import _CATALOGUE, PROGRESS_EVERY_S, RunMetrics, Update

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


class RayBackend:
    """`ray.util.metrics` objects, one per catalogue entry, created in the calling process (the
    controller actor); Ray's metrics agent on its node exports them."""

    def __init__(self):
        from ray.util.metrics import Counter, Gauge, Histogram

        self._metrics = {}
        for m in _CATALOGUE:
            if m.kind == "gauge":
                self._metrics[m.name] = Gauge(m.name, m.description, tag_keys=m.tags)
            elif m.kind == "counter":
                self._metrics[m.name] = Counter(m.name, m.description, tag_keys=m.tags)
            else:
                self._metrics[m.name] = Histogram(m.name, m.description, boundaries=list(m.boundaries),
                                                  tag_keys=m.tags)

    def apply(self, updates: Iterable[Update]) -> None:
        for u in updates:
            metric = self._metrics[u.metric]
            if u.op == "set":
                metric.set(u.value, tags=u.tag_dict)
            elif u.op == "inc":
                if u.value > 0:
                    metric.inc(u.value, tags=u.tag_dict)
                elif u.value == 0:
                    # A counter's series at 0 (ZERO_AT_START): Ray's inc() refuses 0, its record does not.
                    metric._record(0.0, tags=u.tag_dict)
            else:
                metric.observe(u.value, tags=u.tag_dict)


def _default_backend() -> Backend | None:
    """Ray's metrics inside a Ray process; nothing elsewhere (the controller driven by tests)."""
    import ray

    return RayBackend() if ray.is_initialized() else None


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
