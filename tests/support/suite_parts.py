"""Which part of the suite a test belongs to: the `ray` and `procs` markers, set at collection.

`make test-fast` must start no Ray and spawn no process group, and contributors add tests every
day without thinking about it, so a test is marked from what it reaches rather than by hand: its
own body, its fixtures' bodies, and the module-level helpers they call (followed into this repo's
`tests.` and `benchmarks.` modules), read as syntax trees. `ray`: it reaches `ray.init`, a
local cluster (`ray_cluster`, `cluster`, `one_node_ray`, `local_cluster`) or a Ray actor.
`procs`: it forms a torch.distributed group or starts worker processes (`run_ranks`,
`torch.multiprocessing`, `multiprocessing`, `subprocess.Popen`) or runs a Python child
(`sys.executable`); a `subprocess.run` of a tool (kubectl, promtool) is neither. What syntax
cannot see (Ray or a process started by `elastic.` code a test calls) is listed in `BY_HAND`.
`make test-fast` sets `ELASTIC_FAST_ONLY=1`, under which `ray.init`, `init_process_group` and a
`multiprocessing` start raise (`refuse_slow_starts`), so a test missed here fails there, naming
the marker, rather than quietly making the fast part slow.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
from pathlib import Path

RAY_FIXTURES = frozenset({"ray_cluster", "cluster"})  # tests/ray_fixtures.py
RAY_NAMES = frozenset({"ray_cluster", "one_node_ray", "local_cluster", "LocalCluster",
                       "cluster_utils"})
RAY_ATTRS = frozenset({"init", "remote", "get_actor"})  # read on the name `ray`
PROCS_NAMES = frozenset({"run_ranks", "uninterrupted_digests", "init_process_group",
                         "rendezvous_port", "Rendezvous", "multiprocessing",
                         "ProcessPoolExecutor", "Popen"})
PROCS_COMMANDS = ("torch.distributed.run", "torchrun")  # in a command line a test runs
# What syntax cannot see: the process or Ray is started by code a test calls in elastic/ or in a
# script it runs. Keys are node ids or their prefixes (a module: every test in it).
BY_HAND = {
    "tests/test_uploader.py": "procs",  # the checkpoint uploader's child process
    "tests/test_prefetch.py": "procs",  # DataLoader worker processes
    "tests/test_link_speed.py::test_one_buffer_crosses": "procs",  # a rank process per side
    "tests/test_host_syncs.py::test_the_probe_prints": "procs",  # a probe that trains ranks
    "tests/test_user_objects.py::test_the_notebook_style_example": "ray",  # a local Ray run
}
# The real-cluster drills make test runs, one per recovery path; every other drill runs in make
# chaos. They share one module, so make test starts one cluster and one baseline for them.
SMOKE = (
    "tests/test_chaos.py::test_node_kill_with_a_warm_spare_takes_no_storage_round_trip",
    "tests/test_chaos.py::test_node_kill_recovers_bit_identical",  # a peer's memory
    "tests/test_chaos.py::test_node_kill_storage_path_when_peer_restore_is_off",
)
# Process tests too long for make test's 10 minutes (docs/development/suite-durations.txt).
SLOW: tuple[str, ...] = ()
PROCS_MODULES = ("multiprocessing", "torch.multiprocessing")
ROOT = Path(__file__).resolve().parents[2]
FOLLOWED = ("tests.", "benchmarks.")


@functools.lru_cache(maxsize=None)
def _module(path: str) -> tuple[dict[str, ast.AST], dict[str, str], frozenset[str]]:
    """(top-level functions and classes by name, names imported from followed modules -> their
    module, names bound at the top to a multiprocessing module or its members) of one file."""
    tree = ast.parse(Path(path).read_text(), filename=path)
    defs: dict[str, ast.AST] = {}
    imported: dict[str, str] = {}
    procs: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if node.module.startswith(FOLLOWED):
                    imported[alias.asname or alias.name] = node.module
                elif node.module in PROCS_MODULES:
                    procs.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            procs.update(a.asname or a.name for a in node.names if a.name in PROCS_MODULES)
    return defs, imported, frozenset(procs)


@functools.lru_cache(maxsize=None)
def _source_of(module: str) -> str | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    origin = spec.origin if spec else None
    ours = origin and origin.endswith(".py") and Path(origin).is_relative_to(ROOT)
    return origin if ours else None


def _kinds_of(node: ast.AST) -> tuple[set[str], set[str]]:
    """(the kinds this node's own code shows, the names it refers to)."""
    kinds: set[str] = set()
    names: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            names.add(sub.id)
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            if any(c in sub.value for c in PROCS_COMMANDS):
                kinds.add("procs")
        elif isinstance(sub, ast.Attribute):
            names.add(sub.attr)
            on = sub.value.id if isinstance(sub.value, ast.Name) else None
            if on == "ray" and sub.attr in RAY_ATTRS:
                kinds.add("ray")
            if on == "sys" and sub.attr == "executable":
                kinds.add("procs")  # a child interpreter: seconds of imports per test
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in sub.names] + ([sub.module] if isinstance(sub, ast.ImportFrom)
                                                   and sub.module else [])
            if any(m in PROCS_MODULES for m in mods):
                kinds.add("procs")
    if names & RAY_NAMES:
        kinds.add("ray")
    if names & PROCS_NAMES:
        kinds.add("procs")
    return kinds, names


def reached_kinds(path: str, name: str, cls: str | None = None) -> set[str]:
    """The kinds reached from function `name` (a method of `cls` if given) of the file `path`."""
    kinds: set[str] = set()
    seen: set[tuple[str, str]] = set()
    todo: list[tuple[str, ast.AST]] = []
    defs = _module(path)[0]
    start = defs.get(cls) if cls else defs.get(name)
    if cls and start is not None:
        start = next((n for n in ast.iter_child_nodes(start)
                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name),
                     start)
    if start is not None:
        todo.append((path, start))
    while todo:
        file, node = todo.pop()
        found, names = _kinds_of(node)
        kinds |= found
        defs, imported, procs = _module(file)
        if names & procs:
            kinds.add("procs")
        for n in names:
            target: tuple[str, str] | None = None
            if n in defs:
                target = (file, n)
            elif n in imported and (src := _source_of(imported[n])):
                target = (src, n)
            if target and target not in seen:
                seen.add(target)
                node_there = _module(target[0])[0].get(target[1])
                if node_there is not None:
                    todo.append((target[0], node_there))
    return kinds


def item_marks(item) -> set[str]:
    """The markers this module sets on a collected pytest item."""
    nodeid = item.nodeid
    marks = item_kinds(item)
    marks |= {kind for key, kind in BY_HAND.items() if nodeid.startswith(key)}
    if nodeid in SMOKE:
        marks.add("smoke")
    if nodeid.startswith(SLOW):
        marks.add("slow")
    return marks


def item_kinds(item) -> set[str]:
    """The kinds a collected pytest item reaches, through its body and every fixture it uses."""
    kinds: set[str] = set()
    if set(getattr(item, "fixturenames", ())) & RAY_FIXTURES:
        kinds.add("ray")
    fn = getattr(item, "function", None)
    if fn is not None:
        cls = item.cls.__name__ if getattr(item, "cls", None) else None
        kinds |= reached_kinds(inspect.getsourcefile(fn), fn.__name__, cls)
    info = getattr(item, "_fixtureinfo", None)
    for name in (item.fixturenames if info else ()):
        for fdef in info.name2fixturedefs.get(name, ()):
            func = inspect.unwrap(fdef.func)
            src = inspect.getsourcefile(func)
            if src and Path(src).resolve().is_relative_to(ROOT):
                kinds |= reached_kinds(src, func.__name__)
    return kinds


def refuse_slow_starts() -> None:
    """For the whole session (module-scoped fixtures start clusters before any test's own
    fixture could stop them): starting Ray, a process group or a worker process raises, naming
    the marker the test lacks, rather than quietly making the fast part slow."""
    import multiprocessing.process

    import torch.distributed

    def refuse(what: str, marker: str):
        def refused(*args, **kwargs):
            raise RuntimeError(f"this test {what} under make test-fast: mark it {marker} "
                               "(BY_HAND in tests/support/suite_parts.py)")
        return refused

    multiprocessing.process.BaseProcess.start = refuse("starts a worker process", "procs")
    torch.distributed.init_process_group = refuse("forms a process group", "procs")
    try:
        import ray
    except ImportError:
        return
    ray.init = refuse("starts Ray", "ray")


def pytest_collection_finish(session) -> None:
    """With `-p tests.support.suite_parts`: one line per test, `MARKS<tab>nodeid<tab>m1,m2,...`,
    for the check that the parts cover the suite (tests/test_suite_parts.py)."""
    for item in session.items:
        print("MARKS", item.nodeid, ",".join(sorted({m.name for m in item.iter_markers()})),
              sep="\t")  # a parametrized id may hold spaces
