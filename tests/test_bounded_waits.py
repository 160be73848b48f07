"""Every `ray.get` in elastic/ has a timeout (a lint, not a promise): one answer that never comes
(a frozen node, Ray still listing it alive) must not hold a thread, a rank or the driver for
good. A call without one is listed below with why it cannot wait; a listed one that no longer
exists fails too, so the list stays true."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "elastic"

_READY = "its refs came back ready from ray.wait just before: ray.get returns at once"

# (file, function) -> why its ray.get calls without a timeout cannot wait.
ALLOWED: dict[tuple[str, str], str] = {
    ("elastic/group/node_agent.py", "NodeAgent._collect"): _READY,
    ("elastic/group/node_agent.py", "NodeAgents.info"): _READY,
    ("elastic/group/node_agent.py", "NodeAgents.poll_nowait"): _READY,
    ("elastic/group/node_agent.py", "NodeAgents.drain"): _READY,
    ("elastic/group/prestart.py", "PrestartPool.refresh"): _READY,
    ("elastic/group/spares.py", "SparePool.refresh_spares"): _READY,
    ("elastic/group/worker_group.py", "WorkerGroup.form"): _READY,
    ("elastic/group/worker_group.py", "WorkerGroup.collect_runs"): _READY,
    ("elastic/group/worker_group.py", "WorkerGroup.poll_nowait"): _READY,
    ("elastic/trainer.py", "Trainer.fit"): _READY,
}


def _ray_gets() -> list[tuple[str, str, int, bool]]:
    """(file, enclosing function's qualified name, line, bounded) of every `ray.get(` call."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()

        def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(child, (*scope, child.name))
                    continue
                if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                        and child.func.attr == "get" and isinstance(child.func.value, ast.Name)
                        and child.func.value.id == "ray"):
                    timeout = next((k.value for k in child.keywords if k.arg == "timeout"), None)
                    none = isinstance(timeout, ast.Constant) and timeout.value is None
                    bounded = timeout is not None and not none
                    found.append((rel, _qualname(scope), child.lineno, bounded))
                visit(child, scope)

        visit(ast.parse(path.read_text(), str(path)), ())
    return found


def _qualname(scope: tuple[str, ...]) -> str:
    """A nested helper counts as its outermost class and function (`Class.method`)."""
    if len(scope) > 1 and scope[0][:1].isupper():
        return ".".join(scope[:2])
    return scope[0] if scope else "<module>"


def test_no_ray_get_in_elastic_waits_without_a_timeout_unless_listed_with_why():
    gets = _ray_gets()
    assert len(gets) > 10, "the scan found almost no ray.get: it no longer reads the package"
    unbounded = [f"{f}:{line} in {fn}" for f, fn, line, bounded in gets
                 if not bounded and (f, fn) not in ALLOWED]
    assert not unbounded, ("ray.get without timeout= (give it one, or list it in ALLOWED with "
                           "why): " + ", ".join(unbounded))


def test_every_listed_exception_still_names_a_ray_get_without_a_timeout():
    unbounded = {(f, fn) for f, fn, _, bounded in _ray_gets() if not bounded}
    stale = sorted(set(ALLOWED) - unbounded)
    assert not stale, f"listed in ALLOWED, but no ray.get without a timeout is there now: {stale}"
