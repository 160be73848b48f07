"""Two house rules the code keeps by itself, read from the source (no import of what it checks):

1. A comment or docstring that names a file names one that exists. A path is anything like
   `elastic/checkpoint/fencing.py`, `docs/events.md` or `policies/placement.py` (folders joined by
   `/`, ending in a file name with a known extension), found relative to the repository, to
   `elastic/` or to the referring file's own folder; a dotted module name such as
   `elastic.runtime.priority` or `tests.support.workloads` must name a module or package that
   exists (what follows the module, a function or class, is not checked). A placeholder whose
   first folder is in capitals (`DIR/results.jsonl`) and anything after `://` or a leading `/`
   (URLs, `/tmp/...`) are not references. Scanned: every `.py` under elastic/, benchmarks/, tests/.

2. A `_private` name (one leading underscore, not a dunder) belongs to the module that defines it.
   In elastic/ and benchmarks/ (probes included) no module imports another module's private name:
   neither `from elastic.checkpoint.retry import _y` nor `from .retry import _y`, and no `m._y`
   read from an imported module `m` of this repository, even a sibling in the same package. A
   name two modules share is public (renamed where it is defined and at every use) or lives where
   it belongs. Assigning to such an attribute (a probe installing its timing wrapper) is not a
   use; a class's private attribute (`Class._method`) is not a module's name and is not checked.
   tests/ is exempt: a unit test may reach into the internals of the module it tests.

Run: `.venv/bin/python -m pytest tests/test_house.py -q` (no Ray, a few seconds).
"""
import ast
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1]
OURS = ("elastic", "benchmarks", "tests")
EXTENSIONS = "py|md|yaml|yml|json|jsonl|sh|txt|toml|cfg|ini|csv|html|png|svg"
# Not preceded by a word character, '.', '/' or '-': so no URL, absolute path or file-name tail.
PATH = re.compile(rf"(?<![\w./-])((?:[\w.-]+/)+[\w.-]+\.(?:{EXTENSIONS}))(?![\w/])")
DOTTED = re.compile(rf"(?<![\w./-])((?:{'|'.join(OURS)})(?:\.[A-Za-z_]\w*)+)")


def _sources(*tops: str) -> list[pathlib.Path]:
    return sorted(f for top in tops for f in (ROOT / top).rglob("*.py")
                  if "__pycache__" not in f.parts)


def _where(f: pathlib.Path) -> str:
    return str(f.relative_to(ROOT)) if f.is_relative_to(ROOT) else str(f)


def _prose(src: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every module, class and function docstring."""
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                out += [(first.lineno + i, line)
                        for i, line in enumerate(first.value.value.splitlines())]
    return out


def _module_exists(dotted: str) -> bool:
    """Whether `a.b.c...` starts with a module or package of this repository; the rest may be
    attributes."""
    parts = dotted.split(".")
    here = ROOT / parts[0]
    for seg in parts[1:]:
        if (here / seg).is_dir():
            here = here / seg
        elif (here / f"{seg}.py").is_file():
            return True
        else:
            return False
    return True


def _references(f: pathlib.Path, src: str) -> tuple[list[str], list[str]]:
    """(every reference found, the stale ones as 'file:line: reference')."""
    seen, stale = [], []
    for line, text in _prose(src):
        for ref in PATH.findall(text):
            if ref.split("/")[0].isupper():  # DIR/x.json: a placeholder
                continue
            seen.append(ref)
            if not any((base / ref).exists() for base in (ROOT, ROOT / "elastic", f.parent)):
                stale.append(f"{_where(f)}:{line}: {ref}")
        for ref in DOTTED.findall(text):
            seen.append(ref)
            if not _module_exists(ref.rstrip(".")):
                stale.append(f"{_where(f)}:{line}: {ref}")
    return seen, stale


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_of(f: pathlib.Path) -> tuple[str, str]:
    """(the file's module name, the package its relative imports start from)."""
    parts = list(f.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_module(dotted: str) -> bool:
    path = ROOT / dotted.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _private_uses(f: pathlib.Path, src: str) -> tuple[int, list[str]]:
    """(how many imports of this repository's modules were read, the uses of another module's
    private names as 'file:line: what')."""
    me, package = _module_of(f)
    tree = ast.parse(src)
    modules: dict[str, str] = {}  # a local name bound to one of our modules -> that module
    imports, bad = 0, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(node, package)
            if source.split(".")[0] not in OURS:
                continue
            imports += 1
            for alias in node.names:
                if _is_module(f"{source}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{source}.{alias.name}"
                elif _private(alias.name) and source != me:
                    bad.append(f"{_where(f)}:{node.lineno}: from {source} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in OURS:
                    imports += 1
                    modules[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                and _private(node.attr)):
            chain, base = [], node.value
            while isinstance(base, ast.Attribute):
                chain.insert(0, base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                owner = ".".join([modules[base.id], *chain])
                if owner != me and _is_module(owner):
                    bad.append(f"{_where(f)}:{node.lineno}: {owner}.{node.attr}")
    return imports, bad


def test_comments_and_docstrings_name_files_that_exist():
    files = _sources(*OURS)
    found = [_references(f, f.read_text()) for f in files]
    seen = [ref for refs, _ in found for ref in refs]
    stale = [where for _, bad in found for where in bad]
    assert len(files) > 100 and len(seen) > 100, (len(files), len(seen))
    assert not stale, ("comments or docstrings name files or modules that do not exist; point "
                       "them at where the code lives now, or drop them:\n" + "\n".join(stale))


def test_no_module_uses_another_modules_private_names():
    files = _sources("elastic", "benchmarks")
    found = [_private_uses(f, f.read_text()) for f in files]
    assert len(files) > 100 and sum(n for n, _ in found) > 300, len(files)
    bad = [where for _, uses in found for where in uses]
    assert not bad, ("these use a _private name of another module: make it public where it is "
                     "defined (and rename every use) or move it where it belongs:\n"
                     + "\n".join(bad))


def test_the_checks_catch_what_they_look_for():
    """The two checks above pass on a clean tree: here they must find a planted fault of each
    kind, so that a check that finds nothing cannot pass by looking at nothing."""
    f = ROOT / "elastic" / "checkpoint" / "persister.py"
    src = ('"""Moved from elastic/priority.py; see docs/events.md, elastic.nowhere.thing."""\n'
           "# policies/placement.py, elastic.runtime.worker: fine; DIR/x.json: a placeholder\n"
           "# https://example.com/elastic/priority.py and /tmp/elastic/priority.py: not ours\n"
           "from elastic.checkpoint.agreement import _BROKEN, Fenced\n"
           "from .retry import _is_peer_failure\n"
           "from elastic.checkpoint import dcp_io\n"
           "import elastic.checkpoint.persister as me\n"
           "x = dcp_io._written_files(dcp_io.save_shards), me._own\n"
           "dcp_io._probe = dcp_io.UploadBound._private_method\n")
    _, stale = _references(f, src)
    assert stale == [f"{_where(f)}:1: elastic/priority.py", f"{_where(f)}:1: elastic.nowhere.thing"]
    imports, bad = _private_uses(f, src)
    assert imports == 4 and sorted(bad) == sorted([
        f"{_where(f)}:4: from elastic.checkpoint.agreement import _BROKEN",
        f"{_where(f)}:5: from elastic.checkpoint.retry import _is_peer_failure",
        f"{_where(f)}:8: elastic.checkpoint.dcp_io._written_files"]), bad
