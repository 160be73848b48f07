"""Every third-party module the installed `elastic` package imports is one its metadata declares.

Run by tests/install/check.sh with the python of a fresh virtual environment that holds the wheel
and nothing but its declared dependencies (no extras). For each `import X` anywhere in the package
(inside functions too), X must be the standard library, `elastic` itself, or a module of a
distribution named in the wheel's Requires-Dist without an extra. An import inside
`try: ... except ImportError` makes its module an optional one (an extra's): that module may be
missing (its later imports, past the guard, too), but one that is present and undeclared fails
all the same. Declared only through another
dependency does not count: numpy, which only the `plot` and `test` extras brought in, is the case
that broke a user's install (issue 53).

    python declared_imports.py      # exit 0, or 1 naming each undeclared import and its file
"""
from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import pathlib
import re
import sys

DIST = "elastic-trainer"
# Modules of a dependency's own dependencies that are part of that dependency's API and pinned by
# it: pydantic's field metadata are annotated_types objects, its "no default" is pydantic_core's.
PART_OF = {"annotated_types": "pydantic", "pydantic_core": "pydantic"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    """The distributions the wheel requires without an extra."""
    out = set()
    for req in md.requires(DIST) or []:
        name, _, marker = req.partition(";")
        if "extra" in marker:
            continue
        out.add(canonical(re.match(r"[A-Za-z0-9._-]+", name.strip()).group(0)))
    return out


def _optional_lines(tree: ast.AST) -> set[int]:
    """Line numbers of imports inside a try whose handlers catch ImportError."""
    lines = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        if any(h.type is None for h in node.handlers):  # a bare except catches ImportError too
            caught = {"ImportError"}
        else:
            caught = {n.id for h in node.handlers for n in ast.walk(h.type)
                      if isinstance(n, ast.Name)}
        if caught & {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}:
            lines |= {n.lineno for stmt in node.body for n in ast.walk(stmt)
                      if isinstance(n, (ast.Import, ast.ImportFrom))}
    return lines


def imports(package_dir: pathlib.Path) -> list[tuple[str, str, bool]]:
    """(top-level module, file:line, optional) for every absolute import in the package."""
    out = []
    for path in sorted(package_dir.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        optional = _optional_lines(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            where = f"{path.relative_to(package_dir.parent)}:{node.lineno}"
            out += [(n.split(".")[0], where, node.lineno in optional) for n in names]
    return out


def main() -> int:
    spec = importlib.util.find_spec("elastic")  # finds the installed package without running it
    package_dir = pathlib.Path(spec.origin).parent
    want = declared()
    owners = md.packages_distributions()
    found = imports(package_dir)
    guarded = {module for module, _, optional in found if optional}
    bad = []
    for module, where, _ in found:
        if module in sys.stdlib_module_names or module == "elastic":
            continue
        dists = {canonical(d) for d in owners.get(module, [])}
        if PART_OF.get(module) in want or dists & want:
            continue
        if not dists and module in guarded:
            continue  # an extra's module, absent here, whose import is guarded
        why = (f"from {', '.join(sorted(dists))}, not declared" if dists
               else "installed by no declared dependency")
        bad.append(f"{where}: import {module} ({why})")
    if bad:
        print(f"{DIST} imports what its dependencies do not declare (add it to [project] "
              f"dependencies in pyproject.toml, or guard it as an extra's):\n  " + "\n  ".join(bad))
        return 1
    print(f"{len(found)} imports in {package_dir}: each one's module is declared, the standard "
          f"library, or an optional extra's ({', '.join(sorted(want))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
