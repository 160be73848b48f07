"""The heartbeat sidecar and the controller's pinger, on real processes and real UDP (no Ray):
what the controller learns about a worker process from outside its Python."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from elastic import priority
from elastic.heartbeat import Heartbeats, Sidecar

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")]


def settle(hb: Heartbeats, seconds: float) -> dict:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        hb.tick()
        time.sleep(0.01)
    return hb.beats()


@pytest.fixture
def worker():
    """A stand-in worker process and a sidecar watching it."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    side = Sidecar(proc.pid, "127.0.0.1")
    yield proc, side
    for p in (proc, side.proc):
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
    proc.kill()
    side.close()


def test_the_sidecar_reports_the_worker_as_the_kernel_sees_it(worker):
    proc, side = worker
    hb = Heartbeats(interval_s=0.05)
    hb.watch({1: ("127.0.0.1", side.port)})
    beat = settle(hb, 0.3)[1]
    assert beat.state == "S" and beat.age_s < 0.2  # asleep in the kernel: alive
    os.kill(proc.pid, signal.SIGSTOP)
    assert settle(hb, 0.3)[1].state == "T"  # stopped: the node says so at once
    os.kill(proc.pid, signal.SIGCONT)
    assert settle(hb, 0.3)[1].state in ("S", "R")
    proc.kill()
    proc.wait()
    assert settle(hb, 0.3)[1].state == "X"  # gone


def test_a_silent_sidecar_ages_from_its_first_unanswered_ping_and_recovers(worker):
    _, side = worker
    hb = Heartbeats(interval_s=0.05)
    hb.watch({1: ("127.0.0.1", side.port)})
    settle(hb, 0.2)
    os.kill(side.proc.pid, signal.SIGSTOP)  # its node stops
    assert 0.4 <= settle(hb, 0.6)[1].age_s <= 0.8
    os.kill(side.proc.pid, signal.SIGCONT)
    assert settle(hb, 0.3)[1].age_s < 0.2


def test_a_pause_of_the_controller_is_not_a_node_silence(worker):
    _, side = worker
    hb = Heartbeats(interval_s=0.05)
    hb.watch({1: ("127.0.0.1", side.port)})
    settle(hb, 0.2)
    time.sleep(1.0)  # the controller busy elsewhere (a restore): no ping goes out
    assert hb.beats()[1].age_s < 0.1


def test_renumbering_keeps_a_sidecar_and_an_unknown_one_gives_no_evidence(worker):
    _, side = worker
    hb = Heartbeats(interval_s=0.05)
    hb.watch({1: ("127.0.0.1", side.port)})
    settle(hb, 0.2)
    hb.watch({0: ("127.0.0.1", side.port)})  # rank 1 became rank 0
    assert set(hb.beats()) == {0}
    dead_port = Sidecar(os.getpid(), "127.0.0.1")
    dead_port.close()  # nothing listens on its port any more
    hb.watch({0: ("127.0.0.1", side.port), 2: ("127.0.0.1", dead_port.port)})
    assert set(settle(hb, 0.3)) == {0}  # never answered: the controller falls back to polls


def test_the_sidecar_exits_with_its_worker():
    # The worker starts the sidecar; when the worker is SIGKILLed, the pipe closes and the sidecar goes.
    code = ("import sys, time; from elastic.heartbeat import Sidecar; s = Sidecar(__import__('os').getpid(), "
            "'127.0.0.1'); print(s.proc.pid, flush=True); time.sleep(60)")
    w = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    side_pid = int(w.stdout.readline())
    w.kill()
    w.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(side_pid):
        time.sleep(0.05)
    assert not _alive(side_pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] not in "ZX"
    except OSError:
        return False


def test_a_sidecar_started_by_a_spare_at_low_priority_runs_at_normal_priority():
    # A refill spare warms under SCHED_IDLE (elastic/priority.py); its heartbeat must not starve,
    # or a busy node would look stopped.
    code = ("import os; from elastic import priority; from elastic.heartbeat import Sidecar; "
            "low = priority.lower(); s = Sidecar(os.getpid(), '127.0.0.1'); "
            "print(low, os.sched_getscheduler(0) == os.SCHED_IDLE, os.sched_getscheduler(s.proc.pid) == os.SCHED_IDLE)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                         env={**os.environ, priority.BACKGROUND_ENV: "0"}).stdout.split()
    if out[0] != "True":
        pytest.skip("this process may not leave SCHED_IDLE again, so it is never lowered")
    assert out == ["True", "True", "False"]


def test_a_kept_rank_is_said_so_in_the_progress_lines():
    from elastic.report import describe_event
    from elastic.trainer import _Progress
    ev = {"kind": "silence_excused", "rank": 1, "step": 15, "unanswered_s": 4.2, "idle_s": 4.3, "state": "S",
          "heartbeat_age_s": 0.0}
    assert "silence_excused" in _Progress.NOTABLE
    assert describe_event(ev) == ("BUSY rank 1: no poll answered for 4.2s, but its node's heartbeat says the "
                                  "process runs (state S): kept")
