"""The suite's parts (make test-fast, make test, make chaos) cover it whole, and the markers that
split it are set from what each test reaches (tests/support/suite_parts.py). No Ray."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

from _pytest.mark.expression import Expression

from tests.support.suite_parts import reached_kinds

ROOT = Path(__file__).resolve().parents[1]


def _marks_of(target: str) -> str:
    """The `-m` expression of the pytest command `make TARGET` runs (as make would run it)."""
    # Set-up is taken as done: only the command is wanted.
    old = ["-o", ".venv/.installed", "-o", "install-check",
           "-o", ".tools/prometheus/usr/bin/prometheus"]
    out = subprocess.run(["make", "-n", "--no-print-directory", *old, target], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    (line,) = [ln for ln in out.splitlines() if " -m pytest " in ln]
    args = shlex.split(line)
    return args[args.index("-m", args.index("pytest")) + 1]


def _collected() -> dict[str, set[str]]:
    """Every test of the suite, with its markers, as pytest collects it."""
    env = {k: v for k, v in os.environ.items() if k != "ELASTIC_FAST_ONLY"}
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
           "-p", "tests.support.suite_parts"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    rows = [ln.split("\t") for ln in out.stdout.splitlines() if ln.startswith("MARKS\t")]
    assert out.returncode == 0 and rows, out.stdout[-3000:] + out.stderr[-3000:]
    return {nodeid: set(filter(None, marks.split(","))) for _, nodeid, marks in rows}


def test_fast_is_part_of_test_and_test_and_chaos_are_the_whole_suite_once():
    tests = _collected()
    parts = {}
    for target in ("test-fast", "test", "chaos"):
        expr = Expression.compile(_marks_of(target))
        parts[target] = {t for t, marks in tests.items()
                         if expr.evaluate(lambda m, marks=marks: m in marks)}
        assert parts[target], f"make {target} runs no test"
    assert parts["test-fast"] <= parts["test"], sorted(parts["test-fast"] - parts["test"])[:20]
    assert not parts["test"] & parts["chaos"], sorted(parts["test"] & parts["chaos"])[:20]
    left_out = set(tests) - parts["test"] - parts["chaos"]
    assert parts["test"] | parts["chaos"] == set(tests), sorted(left_out)[:20]
    # test-fast starts no Ray and spawns no process group; test runs a real-cluster drill for
    # each recovery path (a warm spare, a peer's memory, storage).
    assert all(not tests[t] & {"ray", "procs", "chaos", "s3"} for t in parts["test-fast"])
    smoke = {t for t in parts["test"] if "ray" in tests[t]}
    assert len(smoke) >= 3, smoke
    assert all({"smoke", "chaos"} <= tests[t] for t in smoke), smoke
    # The drills a fixture cannot show: a local cluster's and a gloo group's users are marked.
    assert all({"ray", "chaos"} <= tests[t] for t in tests if t.startswith("tests/test_chaos.py"))
    assert all("procs" in tests[t] for t in tests if t.startswith("tests/test_collectives.py"))


def _kinds(tmp_path: Path, source: str, name: str) -> set[str]:
    path = tmp_path / f"test_{name}.py"
    path.write_text(textwrap.dedent(source))
    return reached_kinds(str(path), name)


def test_a_test_is_marked_from_the_helpers_it_reaches(tmp_path):
    src = """
        import subprocess
        import torch.multiprocessing as mp
        from tests.ray_fixtures import one_node_ray
        from tests.spawn_ranks import uninterrupted_digests

        def _start():
            with one_node_ray(__name__):
                pass

        def _helper():
            _start()

        def test_ray():
            _helper()

        def test_ranks():
            assert uninterrupted_digests({})

        def test_spawn():
            mp.spawn(print, nprocs=2)

        def test_group():
            import torch.distributed as dist
            dist.init_process_group("gloo", rank=0, world_size=1)

        def test_kubectl():
            subprocess.run(["kubectl", "version"])

        def test_pure():
            assert sorted([2, 1]) == [1, 2]
    """
    names = ("test_ray", "test_ranks", "test_spawn", "test_group", "test_kubectl", "test_pure")
    got = {n: _kinds(tmp_path, src, n) for n in names}
    assert got == {"test_ray": {"ray"}, "test_ranks": {"procs"}, "test_spawn": {"procs"},
                   "test_group": {"procs"}, "test_kubectl": set(), "test_pure": set()}
