"""Servers the tests start as processes of their own (a Ray head, Prometheus): waiting until one
answers over HTTP, and stopping its whole process group."""
from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request


def answers(url: str, proc: subprocess.Popen, timeout_s: float, every_s: float = 0.5) -> bool:
    """True once `url` answers; False if `proc` exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return True
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(every_s)


def stop_group(proc: subprocess.Popen, term_wait_s: float = 5.0) -> None:
    """SIGTERM to the process group (started with start_new_session=True), SIGKILL after `term_wait_s`."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=term_wait_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass
