"""Write the docs' tables that are derived from fastbatch's registry.

    PYTHONPATH=. .tox/vllm/bin/python tools/docs_tables.py          # rewrite them
    PYTHONPATH=. .tox/vllm/bin/python tools/docs_tables.py --check  # exit 1 if stale

Two tables, each written between marker comments wherever a Markdown file of
the project (README.md, docs/*.md) holds them:

    <!-- generated: pieces (tools/docs_tables.py) -->
    ...
    <!-- end generated -->

* ``pieces``: one row per piece of ``fastbatch.registry.NAMES``: its name,
  what it replaces (the targets of its patches, ``registry.piece(name)
  .targets``) and a one-line summary (the first sentence of its patch
  module's "What is replaced:" paragraph, or of its docstring); the name
  links to ``docs/pieces/<name>.md``;
* ``deprecated-names``: the ``FASTBATCH_DISABLE`` names of fastbatch 0.1 and
  the pieces they now name (``registry.DEPRECATED_NAMES``).

Reading the targets imports every patch module, which needs torch: run it in
an environment with torch (the ``vllm`` tox environment).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The files that may hold generated blocks (docs/supported-versions.md and the
# step profiles are written by other tools).
FILES = ("README.md", "docs/README.md", "docs/configuration.md", "docs/design.md")
BLOCK = re.compile(
    r"(?P<start><!-- generated: (?P<kind>[a-z-]+) \(tools/docs_tables\.py\) -->\n)"
    r"(?P<body>.*?)"
    r"(?P<end><!-- end generated -->)",
    re.DOTALL)
SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)\.\s+(?=[A-Z(`]|vLLM)")


def _markdown(text: str) -> str:
    """reStructuredText's inline literals as Markdown's, lines joined."""
    return " ".join(text.split()).replace("``", "`")


def summary(docstring: str) -> str:
    """The first sentence of the "What is replaced:" paragraph of a patch
    module's docstring (or of the docstring), capitalised, in Markdown."""
    paragraphs = [p for p in re.split(r"\n\s*\n", docstring or "") if p.strip()]
    chosen = next((p for p in paragraphs if p.lstrip().startswith("What is replaced:")),
                  paragraphs[0] if paragraphs else "")
    text = _markdown(chosen.strip().removeprefix("What is replaced:"))
    sentence = SENTENCE_END.split(text, maxsplit=1)[0].rstrip(".") + "."
    return sentence[:1].upper() + sentence[1:]


def pieces_table(link_base: str) -> str:
    """The pieces table; ``link_base`` is the path of docs/pieces/ from the
    file that holds it."""
    from fastbatch import registry

    rows = ["| piece (`FASTBATCH_DISABLE` name) | replaces | what that is |",
            "| --- | --- | --- |"]
    for piece in registry.pieces():
        targets = "<br>".join(f"`{target}`" for target in piece.targets)
        text = summary(piece.module.__doc__ or "").replace("|", "\\|")
        rows.append(f"| [`{piece.name}`]({link_base}{piece.name}.md) | {targets} | {text} |")
    return "\n".join(rows) + "\n"


def deprecated_table(link_base: str) -> str:
    """The deprecated ``FASTBATCH_DISABLE`` names and the pieces they name."""
    from fastbatch import registry

    rows = ["| deprecated name (fastbatch 0.1) | piece it names now |", "| --- | --- |"]
    for old, new in sorted(registry.DEPRECATED_NAMES.items()):
        rows.append(f"| `{old}` | [`{new}`]({link_base}{new}.md) |")
    return "\n".join(rows) + "\n"


TABLES: dict[str, Callable[[str], str]] = {
    "pieces": pieces_table,
    "deprecated-names": deprecated_table,
}


def render(path: Path, text: str) -> str:
    """``text`` (the content of ``path``) with every generated block rewritten."""
    link_base = "pieces/" if path.parent.name == "docs" else "docs/pieces/"

    def block(match: re.Match[str]) -> str:
        kind = match["kind"]
        if kind not in TABLES:
            raise SystemExit(f"{path}: unknown generated block {kind!r} "
                             f"(known: {', '.join(TABLES)})")
        return match["start"] + TABLES[kind](link_base) + match["end"]

    return BLOCK.sub(block, text)


def stale_files(root: Path = ROOT, write: bool = False) -> list[str]:
    """The files whose generated blocks are not current (rewritten if ``write``)."""
    stale = []
    for name in FILES:
        path = root / name
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8")
        new = render(path, text)
        if new != text:
            stale.append(name)
            if write:
                path.write_text(new, encoding="utf-8")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a generated block is stale")
    args = parser.parse_args(argv)
    stale = stale_files(write=not args.check)
    if args.check and stale:
        print(f"stale generated tables in {', '.join(stale)}: "
              "run python tools/docs_tables.py", file=sys.stderr)
        return 1
    for name in stale:
        print(f"rewrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
