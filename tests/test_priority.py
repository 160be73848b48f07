"""A spare started beside training runs at the lowest CPU priority until it is built, and only
where it can return to its priority afterwards (elastic/runtime/priority.py). Real processes: the
scheduling policy of every thread, read back from the kernel."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from elastic.runtime import priority

pytestmark = pytest.mark.timeout(120)

# Imports elastic the way a Ray worker does (before anything else), starts torch's threads, then
# returns to normal priority as warm() does; prints every thread's scheduling policy at both points.
CHILD = textwrap.dedent("""
    import json, os, threading
    import elastic
    from elastic.runtime import priority
    import torch
    torch.set_num_threads(2)
    torch.ones(256, 256) @ torch.ones(256, 256)  # starts torch's compute threads
    policies = lambda: sorted({os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")})
    before = policies()
    lowered = priority.lowered()
    restored = priority.restore()
    print(json.dumps({"lowered": lowered, "while_starting": before, "restored": restored, "after": policies()}))
""")


def run_child(env_value: str | None, preexec=None, prefix: list[str] = ()) -> dict:
    env = dict(os.environ)
    env.pop(priority.BACKGROUND_ENV, None)
    if env_value is not None:
        env[priority.BACKGROUND_ENV] = env_value
    out = subprocess.run([*prefix, sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=90,
                         preexec_fn=preexec, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


linux_only = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread scheduling policies are Linux's")


@linux_only
def test_a_background_spare_starts_at_the_lowest_priority_and_returns_to_its_own():
    base = os.sched_getscheduler(0)
    got = run_child("1")
    if not priority._can_return():
        assert got == {"lowered": False, "while_starting": [base], "restored": False, "after": [base]}
        pytest.skip("this process may not raise its priority back: the spare starts at normal priority")
    # Every thread, including torch's that started after the lowering, ran under SCHED_IDLE until restored.
    assert got == {"lowered": True, "while_starting": [os.SCHED_IDLE], "restored": True, "after": [base]}


@linux_only
def test_other_workers_are_left_alone():
    base = os.sched_getscheduler(0)
    assert run_child(None) == {"lowered": False, "while_starting": [base], "restored": False, "after": [base]}


@linux_only
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and util-linux's setpriv to start a child without CAP_SYS_NICE")
def test_where_priority_could_not_be_raised_back_it_is_never_lowered():
    """Without CAP_SYS_NICE and with RLIMIT_NICE 0 (an ordinary user, a container that drops the
    capability), a lowered spare could never return to normal priority and would straggle from
    its first step: it starts at normal priority."""
    def no_nice_rlimit():
        import resource
        resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
    base = os.sched_getscheduler(0)
    assert run_child("1", no_nice_rlimit, ["setpriv", "--bounding-set=-sys_nice"]) == {
        "lowered": False, "while_starting": [base], "restored": False, "after": [base]}
