"""The docs stay true to the code: the configuration page is what the models generate."""
import difflib
import pathlib

from elastic.config import reference

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_configuration_page_is_generated_from_the_models():
    page = ROOT / "docs" / "configuration.md"
    want = reference.render()
    have = page.read_text() if page.exists() else ""
    if have != want:
        diff = "".join(list(difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                                 "docs/configuration.md", "generated"))[:40])
        raise AssertionError(f"docs/configuration.md is stale; regenerate it with\n    {reference.COMMAND}\n"
                             f"from the repository root and commit it.\n{diff}")
