"""The docs: a short README, a page per piece, links that resolve, and the
tables derived from the registry (tools/docs_tables.py) up to date."""

import importlib.util
import re
from pathlib import Path

import pytest

from fastbatch import registry

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 300
# [text](target) and ![alt](target); the target up to whitespace or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"`[^`\n]*`")
GENERATED = re.compile(r"<!-- generated: ([a-z-]+) \(tools/docs_tables\.py\) -->\n"
                       r"(.*?)<!-- end generated -->", re.DOTALL)


def markdown_files():
    return [README, *sorted(DOCS.glob("*.md")), *sorted((DOCS / "pieces").glob("*.md"))]


def relative_links(path):
    """The relative link targets of a Markdown file, outside code."""
    text = CODE_SPAN.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor in the same page
        yield target


def anchors(path):
    """The anchors of a Markdown file's headings, as GitHub makes them."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.*)$", text, re.MULTILINE)}


def docs_tables():
    spec = importlib.util.spec_from_file_location("docs_tables",
                                                  ROOT / "tools" / "docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_is_a_front_door():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_every_piece_has_a_page_and_every_page_a_piece():
    pages = {path.stem for path in (DOCS / "pieces").glob("*.md")}
    assert set(registry.NAMES) - pages == set(), "pieces without docs/pieces/<name>.md"
    assert pages - set(registry.NAMES) == set(), "pages of no piece in docs/pieces/"


def test_every_page_names_its_patch_module_and_its_tests():
    for name in registry.NAMES:
        page = (DOCS / "pieces" / f"{name}.md").read_text(encoding="utf-8")
        assert page.startswith(f"# `{name}`\n"), name
        assert f"(../../fastbatch/patches/{name}.py)" in page, name
        assert f"`tests/test_{name}.py`" in page, name


@pytest.mark.parametrize("path", markdown_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_point_to_files(path):
    broken = [target for target in relative_links(path)
              if not (path.parent / target.split("#", 1)[0]).exists()]
    assert broken == [], f"{path.relative_to(ROOT)} links to missing files"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_anchors_point_to_headings(path):
    text = CODE_SPAN.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))
    targets = [target for target in LINK.findall(text) if "#" in target
               and not re.match(r"[a-z][a-z0-9+.-]*:", target)]
    broken = []
    for target in targets:
        file, anchor = target.split("#", 1)
        linked = path.parent / file if file else path
        if linked.suffix == ".md" and linked.exists() and anchor not in anchors(linked):
            broken.append(target)
    assert broken == [], f"{path.relative_to(ROOT)} links to missing headings"


def test_the_link_check_finds_links():
    """A check that reads no link would pass on anything."""
    targets = list(relative_links(README))
    assert "docs/configuration.md" in targets
    assert all(f"docs/pieces/{name}.md" in targets for name in registry.NAMES)
    assert "pieces/async_output_token_ids.md" in list(relative_links(DOCS / "configuration.md"))
    assert "check-before-you-start-python--m-fastbatch" in anchors(README)


def test_the_generated_blocks_are_where_the_docs_need_them():
    blocks = {path.name if path.parent == ROOT else str(path.relative_to(ROOT)):
              GENERATED.findall(path.read_text(encoding="utf-8")) for path in markdown_files()}
    assert [kind for kind, _ in blocks["README.md"]] == ["pieces"]
    assert [kind for kind, _ in blocks["docs/configuration.md"]] == ["deprecated-names"]
    for name, found in blocks.items():
        assert all(body.strip() for _, body in found), f"an empty generated block in {name}"


def test_old_names_only_in_the_deprecated_table():
    """The docs use the pieces' names; fastbatch 0.1's are in one table."""
    old = "|".join(sorted(registry.DEPRECATED_NAMES, key=len, reverse=True))
    used = re.compile(rf"FASTBATCH_DISABLE=({old})\b")
    for path in markdown_files():
        assert used.findall(path.read_text(encoding="utf-8")) == [], path.relative_to(ROOT)


def test_summaries_are_first_sentences():
    tables = docs_tables()
    docstring = ("Patch: ``x``.\n\nWhat is replaced: the method that does\n``y.z()`` "
                 "per request, e.g. this.  vLLM calls it often.\n\nWhy: speed.")
    assert tables.summary(docstring) == "The method that does `y.z()` per request, e.g. this."
    assert tables.summary("One line. Two.") == "One line."


@pytest.mark.vllm
def test_the_generated_tables_are_current():
    """``python tools/docs_tables.py`` rewrites them (it imports every patch
    module, which needs torch)."""
    assert docs_tables().stale_files() == [], "run python tools/docs_tables.py"


@pytest.mark.vllm
def test_the_pieces_table_lists_every_target():
    tables = docs_tables()
    table = tables.pieces_table("docs/pieces/")
    for piece in registry.pieces():
        row = next(line for line in table.splitlines() if line.startswith(f"| [`{piece.name}`]"))
        assert all(f"`{target}`" in row for target in piece.targets), piece.name
