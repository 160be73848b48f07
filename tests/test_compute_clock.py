"""The compute clock the straggler policy reads: on a CPU the wall time from start to stop; on a
GPU the time between two CUDA events on the stream, which is the work, not its launch. This
machine has no GPU: the CUDA path runs here against a stand-in for `torch.cuda.Event` whose
timestamps are a fake stream's, so the test checks what the clock records and reads, in which
order and unit, not CUDA itself."""
import torch

from elastic.runtime import compute_clock
from elastic.runtime.compute_clock import ComputeClock


class FakeTime:
    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now


def test_on_a_cpu_it_is_the_wall_time_from_start_to_stop(monkeypatch):
    t = FakeTime()
    monkeypatch.setattr(compute_clock.time, "perf_counter", t.perf_counter)
    clock = ComputeClock(torch.device("cpu"))
    clock.start()
    t.now += 0.25  # forward and backward
    clock.stop()
    t.now += 3.0  # waiting for the other ranks in the reduction: not the rank's own time
    assert clock.seconds() == 0.25


class FakeStream:
    """Kernels queued by the host run later: the stream's clock runs behind the host's."""
    def __init__(self):
        self.gpu_ms = 0.0
        self.synchronized = []


def test_on_a_gpu_it_is_the_stream_time_between_two_events_not_the_launch(monkeypatch):
    t, stream = FakeTime(), FakeStream()

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing  # elapsed_time needs timing events
            self.at = None

        def record(self):
            self.at = stream.gpu_ms  # when the stream reaches it

        def synchronize(self):
            stream.synchronized.append(self)

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(compute_clock.time, "perf_counter", t.perf_counter)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    clock = ComputeClock(torch.device("cuda", 0))
    clock.start()
    t.now += 0.002  # the host launches forward and backward in 2 ms ...
    stream.gpu_ms += 400.0  # ... that the GPU runs for 400 ms (a throttled one)
    clock.stop()
    t.now += 0.5
    stream.gpu_ms += 50.0  # the reduction's wait, after stop
    assert clock.seconds() == 0.4  # not the 2 ms launch, and not the wait
    assert len(stream.synchronized) == 1  # read after waiting for the stop event
