"""The runtime environment the controller, node agents and workers start with: what they need to
import the job's code.

Under `ray job submit --working-dir` (or `py_modules`) Ray ships the code, and nothing is added.
Otherwise, on a cluster that shares the driver's disk (local, or embedded), the driver's working
directory and PYTHONPATH are put on the workers' PYTHONPATH, but only when the job's modules
cannot be imported without them: a Ray actor with a runtime environment of its own cannot use
the Python processes Ray keeps started for the job, and starts one (three one-CPU actors at once
here: a median 2.31 s from asking to the constructor, against 1.41 s in pooled processes;
`benchmarks/probes/actor_env.py`).
Whether they can is asked of a fresh interpreter, once per driver: the same Python, in an empty
folder, with neither of those paths (a package installed in the environment, editable or not,
is found there; a module beside the driver's script is not).
"""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile

import ray

_REF = re.compile(r"^([A-Za-z_]\w*)(?:\.\w+)*:[A-Za-z_][\w.]*$")  # "package.module:function"


def job_packages(job_json: str) -> tuple[str, ...]:
    """The top-level packages of every 'module:function' the job names, of every object given
    from Python (elastic/config/objects.py: its module, "__main__" for a script's or a
    notebook's), and elastic's. Pure."""
    found = {"elastic"}

    def walk(v) -> None:
        if isinstance(v, dict) and "cloudpickle" in v:
            found.add(str(v.get("module") or "__main__").split(".")[0])
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, str):
            m = _REF.match(v)
            if m:
                found.add(m.group(1))
    walk(json.loads(job_json))
    return tuple(sorted(found))


@functools.lru_cache(maxsize=32)
def importable_bare(packages: tuple[str, ...]) -> bool:
    """Whether a fresh interpreter of this Python, in an empty folder and without PYTHONPATH,
    finds every one of `packages` (found, not imported). False if it cannot tell."""
    code = ("import importlib.util, sys; "
            f"sys.exit(0 if all(importlib.util.find_spec(p) for p in {list(packages)!r}) else 1)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        with tempfile.TemporaryDirectory() as empty:
            return subprocess.run([sys.executable, "-c", code], cwd=empty, env=env, timeout=60,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def worker_runtime_env(job_json: str) -> dict | None:
    """None when the job's code reaches the workers without help; else PYTHONPATH set to the
    driver's working directory and PYTHONPATH."""
    job_env = ray.get_runtime_context().runtime_env or {}
    if job_env.get("working_dir") or job_env.get("py_modules"):
        return None
    packages = job_packages(job_json)
    # An object of __main__ travels by value, but what it refers to by name (a module beside the
    # script) must be importable there: such a job gets the driver's paths.
    if "__main__" not in packages and importable_bare(packages):
        return None
    paths = [os.getcwd()] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}}
