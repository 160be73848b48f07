"""The docs stay true to the code and to themselves: the configuration page is what the models
generate, the command's page what its parser generates, the README stays short, and every
relative link lands on a file (and heading) that exists."""
import difflib
import pathlib
import re

from elastic.config import reference

ROOT = pathlib.Path(__file__).resolve().parents[1]
README_MAX_LINES = 300


def _is_generated(name: str, want: str, command: str) -> None:
    page = ROOT / "docs" / name
    have = page.read_text() if page.exists() else ""
    if have != want:
        diff = "".join(list(difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                                 f"docs/{name}", "generated"))[:40])
        raise AssertionError(f"docs/{name} is stale; regenerate it with\n    {command}\n"
                             f"from the repository root and commit it.\n{diff}")


def test_configuration_page_is_generated_from_the_models():
    _is_generated("configuration.md", reference.render(), reference.COMMAND)


def test_cli_page_is_generated_from_the_parser_and_names_every_option():
    from elastic import cli_reference
    from elastic.cli import parser, subparsers
    page = cli_reference.render()
    _is_generated("cli.md", page, cli_reference.COMMAND)
    top = parser()
    flags = [flag for _, p in [("", top), *subparsers(top)]
             for a in p._actions for flag in a.option_strings]
    assert len(flags) > 20 and "--no-per-rank" in flags and "--trace" in flags
    assert all(flag in page for flag in flags), [flag for flag in flags if flag not in page]
    # each command's table has a row for each of its arguments, `--per-rank / --no-per-rank` too
    rows = [f"| `{cli_reference._flags(a)}` | {cli_reference._cell(a.help)}"
            for _, p, _ in cli_reference.commands() for a in cli_reference._arguments(p)]
    missing = [row for row in rows if row not in page]
    assert len(rows) > 10 and all(row in page for row in rows), missing


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move the detail into a page under docs/ "
        f"and link it")


def _pages() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without code: a link inside a code block or a code span is an example, not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: the heading's text, lower case, without punctuation, spaces as hyphens;
    a repeated heading gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        words = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
        slug = re.sub(r"[^\w\- ]", "", words.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_relative_links_point_at_files_that_exist():
    broken = []
    for page in _pages():
        text = page.read_text()
        for target in LINK.findall(_prose(text)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                broken.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "broken links:\n" + "\n".join(broken)
