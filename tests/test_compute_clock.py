"""The compute clock the straggler policy reads: on a CPU the wall time from start to stop (CPU
time where the compute holds collectives: fsdp, tp); on a GPU the time between two CUDA events on the stream, which is the work, not its launch. This
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


def test_cpu_time_leaves_out_a_wait_inside_the_compute():
    """FSDP's and tp's collectives sit inside the forward and backward: a rank that waits there for
    a slow peer (here: sleeps, as a blocked gloo wait does) is not charged for it by CPU time,
    where the wall clock charges it in full. Real clocks: the wait is 0.2 s, the work ~0.05 s."""
    import time

    def step():
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:  # the rank's own work
            pass
        time.sleep(0.2)  # waiting for the slowest rank of its group

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the training thread's CPU time, as a one-thread rank reads it
    try:
        wall, cpu = ComputeClock(torch.device("cpu")), ComputeClock(torch.device("cpu"), cpu_time=True)
    finally:
        torch.set_num_threads(threads)
    wall.start(), cpu.start()
    step()
    wall.stop(), cpu.stop()
    assert wall.seconds() >= 0.25
    assert 0.0 < cpu.seconds() < 0.15, cpu.seconds()  # the work (0.05 s, less when the core is shared)


def test_which_jobs_time_their_compute_by_cpu_time():
    from types import SimpleNamespace
    from elastic.runtime.compute_clock import cpu_time_counts

    def job(strategy, tp=1):
        return SimpleNamespace(train=SimpleNamespace(strategy=strategy, tp=SimpleNamespace(size=tp)))
    assert cpu_time_counts(job("fsdp")) and cpu_time_counts(job("ddp", tp=2))
    assert not cpu_time_counts(job("ddp")) and not cpu_time_counts(job("pipeline"))
