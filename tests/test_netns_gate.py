"""The partition drills (tests/test_partition.py, tests/test_netns.py) need root, `ip` and `tc`.
Where those are missing they skip, except under CI=true, where they fail: CI runs as root with
iproute2, so a skip there would hide a broken set-up behind a green run. Each module is run
here as its own pytest with a PATH that holds neither `ip` nor `tc` (nothing starts: the
check comes before any cluster)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DRILLS = ("tests/test_partition.py", "tests/test_netns.py")

pytestmark = pytest.mark.timeout(240)


def _run_without_iproute2(tmp_path, ci: bool) -> tuple[int, str]:
    empty = tmp_path / "bin"
    empty.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PATH"] = str(empty)
    if ci:
        env["CI"] = "true"
    cmd = [sys.executable, "-m", "pytest", *DRILLS, "-q", "-rfEs", "-p", "no:cacheprovider"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    return p.returncode, p.stdout + p.stderr


def _count(out: str, what: str) -> int:
    m = re.search(rf"(\d+) {what}", out.strip().splitlines()[-1] if out.strip() else "")
    return int(m.group(1)) if m else 0


def test_the_partition_drills_fail_under_ci_where_they_cannot_run_and_skip_elsewhere(tmp_path):
    rc, out = _run_without_iproute2(tmp_path, ci=True)
    errors = _count(out, "error")
    assert rc != 0 and errors > 0, (
        f"under CI=true the drills did not fail (rc {rc}):\n{out[-3000:]}")
    assert _count(out, "passed") == 0 and _count(out, "skipped") == 0, out[-3000:]
    said = "CI=true, and the network-namespace drill cannot run here: `ip`/`tc` missing"
    assert said in out, out[-3000:]
    rc, out = _run_without_iproute2(tmp_path, ci=False)
    assert rc == 0 and _count(out, "skipped") == errors, f"(rc {rc}):\n{out[-3000:]}"  # every test
    assert _count(out, "error") == 0 and _count(out, "passed") == 0, out[-3000:]
