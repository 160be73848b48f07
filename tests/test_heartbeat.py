"""The heartbeat sidecar and the controller's pinger, on real processes and real UDP (no Ray):
what the controller learns about a worker process from outside its Python."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from elastic.runtime import priority
from elastic.runtime.heartbeat import Heartbeats, Sidecar
from elastic.runtime.ping_auth import PingAuth
from elastic.runtime.pinger import PingerProcess
from tests.support.fake_group import FakeClock

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")]


INTERVAL_S = 0.05
AUTH = PingAuth.new("127.0.0.1")  # the controller's address and key: the pingers here send from it


def rounds(hb: Heartbeats, clock: FakeClock, n: int) -> None:
    """`n` rounds of pings, one interval of fake time apart, then a millisecond more: an
    unanswered ping's age is then exact. Real time only lets datagrams travel."""
    for _ in range(n):
        clock.advance(INTERVAL_S)
        hb.tick()
        time.sleep(0.005)
    clock.advance(0.001)


def answered(hb: Heartbeats, rank: int, limit_s: float = 10.0):
    """`rank`'s beat once every ping sent has its answer (age 0). Real time bounds only the wait
    for the datagrams; past it the beat is returned as it is, for the assertion to judge."""
    deadline = time.monotonic() + limit_s
    while True:
        beat = hb.beats().get(rank)
        if (beat is not None and beat.age_s == 0.0) or time.monotonic() > deadline:
            return beat
        time.sleep(0.01)


def kernel_state(pid: int, states: str, limit_s: float = 10.0) -> None:
    """Wait until the kernel shows `pid` in one of `states` (a signal takes effect when the
    target next runs, not when kill() returns); real time bounds only that wait."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0].decode() in states:
                return
        time.sleep(0.005)


def pinger(side: Sidecar, pid: int, rank: int = 1) -> tuple[Heartbeats, FakeClock]:
    clock = FakeClock()
    hb = Heartbeats(AUTH, interval_s=INTERVAL_S, clock=clock)
    hb.watch({rank: ("127.0.0.1", side.port, pid)})
    return hb, clock


@pytest.fixture
def worker():
    """A stand-in worker process and a sidecar watching it."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    side = Sidecar([proc.pid], "127.0.0.1", AUTH)
    # Asleep before any test looks: until its Python has started it runs (R), and on a loaded
    # machine that outlasted the sidecar's start (CI saw R where the test expected S).
    kernel_state(proc.pid, "S")
    yield proc, side
    for p in (proc, side.proc):
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
    proc.kill()
    side.close()


def test_the_sidecar_reports_the_worker_as_the_kernel_sees_it(worker):
    proc, side = worker
    hb, clock = pinger(side, proc.pid)
    rounds(hb, clock, 3)
    beat = answered(hb, 1)
    assert beat.state == "S" and beat.age_s == 0.0  # asleep in the kernel: alive
    os.kill(proc.pid, signal.SIGSTOP)
    # The kill returns before the target has stopped: woken to take the signal, it shows R until
    # it has (CI saw an answer of R on a loaded machine). Once the kernel shows it stopped, the
    # node says so at its next answer.
    kernel_state(proc.pid, "T")
    rounds(hb, clock, 1)
    assert answered(hb, 1).state == "T"
    os.kill(proc.pid, signal.SIGCONT)
    kernel_state(proc.pid, "SR")
    rounds(hb, clock, 1)
    assert answered(hb, 1).state in ("S", "R")
    proc.kill()
    proc.wait()
    rounds(hb, clock, 1)
    assert answered(hb, 1).state == "X"  # gone


def test_a_silent_sidecar_ages_from_its_first_unanswered_ping_and_recovers(worker):
    proc, side = worker
    hb, clock = pinger(side, proc.pid)
    rounds(hb, clock, 2)
    assert answered(hb, 1).age_s == 0.0
    os.kill(side.proc.pid, signal.SIGSTOP)  # its node stops
    rounds(hb, clock, 12)  # the first of these pings went out 11 intervals and a millisecond ago
    assert hb.beats()[1].age_s == pytest.approx(11 * INTERVAL_S + 0.001)
    os.kill(side.proc.pid, signal.SIGCONT)  # it answers the pings it was sent meanwhile
    assert answered(hb, 1).age_s == 0.0


def test_a_node_whose_sidecar_is_gone_refuses_the_pings_until_it_answers_again(worker):
    """The machine is up but nothing listens on the sidecar's port (its agent died, and the sidecar
    with it): the node's kernel answers each ping with an ICMP "port unreachable", read from the
    pinger's error queue. A stopped sidecar is silent, not refused; an answer to a later ping ends
    the refusal."""
    import socket

    proc, side = worker
    hb, clock = pinger(side, proc.pid)
    rounds(hb, clock, 2)
    assert not answered(hb, 1).refused
    os.kill(side.proc.pid, signal.SIGSTOP)  # stopped: its socket is still bound, nothing is refused
    rounds(hb, clock, 3)
    assert not hb.beats()[1].refused and hb.beats().refused() == []
    os.kill(side.proc.pid, signal.SIGCONT)
    assert answered(hb, 1).age_s == 0.0
    port = side.port
    side.close()  # gone: its port closed
    rounds(hb, clock, 2)
    until(lambda: hb.beats()[1].refused)
    assert hb.beats().refused() == [1] and hb.beats()[1].state == "S"  # its last answer, before it went
    # Something answers on that port again (a sidecar, as far as the pinger can tell: the token
    # and the address match): the refusal is over.
    back = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    back.bind(("127.0.0.1", port))
    back.settimeout(5)
    try:
        clock.advance(INTERVAL_S)
        hb.tick()
        ping, addr = back.recvfrom(128)
        back.sendto(ping + f" {proc.pid} S 0".encode(), addr)
        until(lambda: not hb.beats()[1].refused)
    finally:
        back.close()


def test_a_pause_of_the_controller_is_not_a_node_silence(worker):
    proc, side = worker
    hb, clock = pinger(side, proc.pid)
    rounds(hb, clock, 2)
    assert answered(hb, 1).age_s == 0.0
    clock.advance(1.0)  # the controller busy elsewhere (a restore): no ping goes out
    assert hb.beats()[1].age_s == 0.0


def test_renumbering_keeps_a_sidecar_and_an_unknown_one_gives_no_evidence(worker):
    proc, side = worker
    hb, clock = pinger(side, proc.pid)
    rounds(hb, clock, 2)
    assert answered(hb, 1) is not None
    hb.watch({0: ("127.0.0.1", side.port, proc.pid)})  # rank 1 became rank 0
    assert set(hb.beats()) == {0}
    dead_port = Sidecar([os.getpid()], "127.0.0.1", AUTH)
    dead_port.close()  # nothing listens on its port any more
    hb.watch({0: ("127.0.0.1", side.port, proc.pid), 2: ("127.0.0.1", dead_port.port, os.getpid())})
    rounds(hb, clock, 6)
    assert answered(hb, 0).age_s == 0.0
    assert set(hb.beats()) == {0}  # never answered: the controller falls back to polls


def test_the_sidecar_exits_with_its_worker():
    # The worker starts the sidecar; when the worker is SIGKILLed, the pipe closes and the sidecar goes.
    code = ("import sys, time; from elastic.runtime.heartbeat import Sidecar; "
            "from elastic.runtime.ping_auth import PingAuth; s = Sidecar([__import__('os').getpid()], "
            "'127.0.0.1', PingAuth.new('127.0.0.1')); print(s.proc.pid, flush=True); time.sleep(60)")
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
    # A refill spare warms under SCHED_IDLE (elastic/runtime/priority.py); its heartbeat must not
    # starve, or a busy node would look stopped.
    code = ("import os; from elastic.runtime import priority; from elastic.runtime.heartbeat import Sidecar; "
            "from elastic.runtime.ping_auth import PingAuth; "
            "low = priority.lower(); s = Sidecar([os.getpid()], '127.0.0.1', PingAuth.new('127.0.0.1')); "
            "print(low, os.sched_getscheduler(0) == os.SCHED_IDLE, os.sched_getscheduler(s.proc.pid) == os.SCHED_IDLE)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                         env={**os.environ, priority.BACKGROUND_ENV: "0"}).stdout.split()
    if out[0] != "True":
        pytest.skip("this process may not leave SCHED_IDLE again, so it is never lowered")
    assert out == ["True", "True", "False"]


def test_a_kept_rank_is_said_so_in_the_progress_lines():
    from elastic.observability.report import describe_event
    from elastic.trainer import _Progress
    ev = {"kind": "silence_excused", "rank": 1, "step": 15, "unanswered_s": 4.2, "idle_s": 4.3, "state": "S",
          "heartbeat_age_s": 0.0}
    assert "silence_excused" in _Progress.NOTABLE
    assert describe_event(ev) == ("BUSY rank 1: no poll answered for 4.2s, but its node's heartbeat says the "
                                  "process runs (state S): kept")


def test_the_sidecar_listens_on_the_nodes_address_only(worker):
    """Bound to the address the worker gave it, not to every interface: a ping to another local
    address at the same port goes unanswered."""
    import socket
    proc, side = worker
    token = AUTH.token("127.0.0.1", side.port)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((AUTH.ip, 0))
    s.settimeout(1.0)
    try:
        s.sendto(token + b":1", ("127.0.0.2", side.port))
        with pytest.raises(OSError):  # a timeout or a refusal: no answer either way
            s.recvfrom(256)
        s.sendto(token + b":2", ("127.0.0.1", side.port))
        assert s.recvfrom(256)[0].startswith(token + b":2 ")  # its own address answers
    finally:
        s.close()


def test_the_sidecar_answers_only_the_controllers_address_with_its_token(worker):
    """Who asks learns the node's worker pids and their states: a ping from another address, or
    with a wrong or missing token, gets nothing back (real UDP, two addresses of loopback)."""
    import socket
    proc, side = worker
    token = AUTH.token("127.0.0.1", side.port)
    controller, stranger = (socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2))
    try:
        controller.bind((AUTH.ip, 0))
        stranger.bind(("127.0.0.2", 0))
        other_key = PingAuth.new(AUTH.ip).token("127.0.0.1", side.port)  # another run's controller
        refused = [(stranger, token + b":1"), (controller, other_key + b":2"), (controller, b":3"),
                   (controller, b"4"), (controller, token[:-1] + b":5"), (stranger, b"6")]
        for sock, ping in refused:
            sock.sendto(ping, ("127.0.0.1", side.port))
        controller.sendto(token + b":7", ("127.0.0.1", side.port))
        # The sidecar reads its socket in order: once the last ping's answer is here, an answer to
        # any ping before it would have been sent, and on loopback delivered, first.
        controller.settimeout(10)
        answer = controller.recv(256)
        assert answer.split()[:3] == [token + b":7", str(proc.pid).encode(), b"S"]
        for sock in (controller, stranger):
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(256)
    finally:
        controller.close()
        stranger.close()
    # The pinger sends from the controller's address, whichever interface the route would take.
    elsewhere = PingAuth.new("127.0.0.2")
    side2 = Sidecar([proc.pid], "127.0.0.1", elsewhere)
    try:
        clock = FakeClock()
        hb = Heartbeats(elsewhere, interval_s=INTERVAL_S, clock=clock)
        hb.watch({1: ("127.0.0.1", side2.port, proc.pid)})
        rounds(hb, clock, 2)
        assert answered(hb, 1).state == "S"
        assert all(sock.getsockname()[0] == "127.0.0.2" for sock in hb._socks.values()) and hb._socks
    finally:
        side2.close()


def test_a_forged_answer_from_another_address_keeps_no_rank_alive(worker):
    """A rank whose node went silent cannot be kept alive by someone else on the network answering
    for it: tokens are random and only answers from the sidecar's own address count."""
    import socket
    proc, side = worker
    hb, clock = pinger(side, proc.pid)
    rounds(hb, clock, 2)
    assert answered(hb, 1).state == "S"
    token = hb._token[("127.0.0.1", side.port)]
    assert len(token) == 16 and token != b"1"  # random, not a counter
    os.kill(side.proc.pid, signal.SIGSTOP)  # the node goes silent
    rounds(hb, clock, 3)
    forger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        forger.bind(("127.0.0.2", 0))
        for sock in hb._socks.values():  # the answer a forger would send: right token, newest ping, "R"
            forger.sendto(token + b":" + str(hb._seq).encode() + f" {proc.pid} R 1".encode(), sock.getsockname())
        time.sleep(0.05)
        assert hb.beats()[1].age_s > 0  # still silent: the forged answer did not count
    finally:
        forger.close()
        os.kill(side.proc.pid, signal.SIGCONT)


def test_one_sidecar_answers_for_every_pid_its_agent_tells_it(worker):
    """A node's sidecar watches the pids its agent gives it (one line on its stdin), and the
    controller reads each rank's state from the one answer of its node."""
    proc, side = worker
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        kernel_state(other.pid, "S")
        clock = FakeClock()
        hb = Heartbeats(AUTH, interval_s=INTERVAL_S, clock=clock)
        hb.watch({1: ("127.0.0.1", side.port, proc.pid), 2: ("127.0.0.1", side.port, other.pid)})
        rounds(hb, clock, 2)
        assert answered(hb, 1).state == "S"
        assert 2 not in hb.beats()  # not told yet: no evidence for it
        side.watch([proc.pid, other.pid])
        os.kill(other.pid, signal.SIGSTOP)
        kernel_state(other.pid, "T")
        deadline = time.monotonic() + 10
        while 2 not in hb.beats() and time.monotonic() < deadline:
            rounds(hb, clock, 1)
        rounds(hb, clock, 1)
        assert answered(hb, 2).state == "T" and answered(hb, 1).state == "S"
        assert hb.pings_sent == hb._seq  # one ping per node per round (two ranks here), not per rank
    finally:
        os.kill(other.pid, signal.SIGCONT)
        other.kill()


def until(check, limit_s: float = 10.0):
    """Wait for `check()` to hold; real time bounds only the wait."""
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.01)


def test_the_pinger_process_pings_and_reads_answers_while_the_caller_does_neither(worker):
    """As the worker group runs it: the pings go out from a process of its own, and `beats()`
    returns its newest snapshot without waiting. A node's silence ages and its return shows; a
    pinger that dies leaves no evidence (the polls alone judge), and never blocks the caller."""
    proc, side = worker
    hb = PingerProcess(AUTH, interval_s=0.05)
    hb.watch({1: ("127.0.0.1", side.port, proc.pid)})
    try:
        until(lambda: 1 in hb.beats() and hb.beats()[1].state == "S")
        sent = hb.pings_sent
        until(lambda: hb.beats() is not None and hb.pings_sent >= sent + 3)
        assert hb.pings_sent == hb.rounds  # one ping per node (one here) per round
        os.kill(side.proc.pid, signal.SIGSTOP)  # its node stops
        until(lambda: hb.beats()[1].age_s > 0.2)
        os.kill(side.proc.pid, signal.SIGCONT)
        until(lambda: hb.beats()[1].age_s == 0.0)
        assert not hb.beats()[1].refused
        side.close()  # its node's sidecar is gone: the refusals reach the caller too
        until(lambda: hb.beats().refused() == [1])
        hb.proc.kill()  # the pinger dies
        until(lambda: 1 not in hb.beats())
    finally:
        if side.proc.poll() is None:
            os.kill(side.proc.pid, signal.SIGCONT)
        hb.close()
    assert hb.proc.poll() is not None


def test_a_fresh_snapshot_shows_a_silence_that_began_after_the_last_call(worker):
    """`beats()` answers with the snapshot the previous call asked for: after a long wait
    elsewhere (a recovery's blocking poll, 4 s on a loaded machine) that snapshot shows a node
    stopped during the wait as alive, and the frozen survivor of churn seed 2 went into a
    formation that could not complete. `fresh_within_s` waits for one taken after the call."""
    proc, side = worker
    hb = PingerProcess(AUTH, interval_s=0.05)
    hb.watch({1: ("127.0.0.1", side.port, proc.pid)})
    try:
        until(lambda: 1 in hb.beats() and hb.beats()[1].age_s == 0.0)
        time.sleep(0.2)  # the answer to that last call's request arrives: a snapshot of a live node
        os.kill(side.proc.pid, signal.SIGSTOP)  # its node stops
        time.sleep(1.0)  # the caller waits elsewhere
        fresh = hb.beats(fresh_within_s=5.0)[1]
        assert fresh.age_s > 0.0, fresh  # the stale snapshot says 0.0: answered before the stop
    finally:
        if side.proc.poll() is None:
            os.kill(side.proc.pid, signal.SIGCONT)
        hb.close()


def test_the_pinger_works_from_a_process_with_more_than_1024_files_open(worker):
    """A controller in a long-lived process (a test session, a driver with many Ray
    connections) may hand the pinger's pipes file descriptors past 1,024, where select() fails."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        pytest.skip(f"RLIMIT_NOFILE {soft}: cannot open 1,100 files here")
    proc, side = worker
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        hb = PingerProcess(AUTH, interval_s=0.05)
        assert hb.proc.stdout.fileno() > 1024
        hb.watch({1: ("127.0.0.1", side.port, proc.pid)})
        until(lambda: 1 in hb.beats() and hb.beats()[1].state == "S")
        hb.close()
    finally:
        for fd in held:
            os.close(fd)
