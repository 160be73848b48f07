"""The docs stay true to the code and to themselves: the configuration page is what the models
generate, the README stays short, and every relative link lands on a file (and heading) that exists."""
import difflib
import pathlib
import re

from elastic.config import reference

ROOT = pathlib.Path(__file__).resolve().parents[1]
README_MAX_LINES = 300


def test_configuration_page_is_generated_from_the_models():
    page = ROOT / "docs" / "configuration.md"
    want = reference.render()
    have = page.read_text() if page.exists() else ""
    if have != want:
        diff = "".join(list(difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                                 "docs/configuration.md", "generated"))[:40])
        raise AssertionError(f"docs/configuration.md is stale; regenerate it with\n    {reference.COMMAND}\n"
                             f"from the repository root and commit it.\n{diff}")


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
