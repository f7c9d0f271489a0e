"""The shape of fastbatch's imports, read from its source (nothing imported).

No two of fastbatch's modules import each other, directly or through others
(every import counts: at module level, in a function, or for type checking
only), and no piece's patch module (``fastbatch/patches/<piece>.py``) imports
another piece's: what pieces share lives in the private modules beside them.
"""

import ast
from pathlib import Path

from fastbatch import registry

PACKAGE = Path(registry.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> set[str]:
    """The modules of fastbatch that module ``name`` imports."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # ``from package import module`` imports the module itself
            candidates = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES
                          else base for alias in node.names]
        else:
            continue
        found.update(candidate for candidate in candidates if candidate in MODULES)
    found.discard(name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (module -> modules it imports) that a
    depth-first walk meets, each as a path that closes on itself (none: no
    circle at all)."""
    found: list[list[str]] = []
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        path.append(node)
        for following in sorted(graph.get(node, ())):
            if state.get(following) == "open":
                found.append([*path[path.index(following):], following])
            elif following not in state:
                visit(following, path)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"a"}}) == [["a", "a"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_import_reader_sees_every_kind_of_import():
    graph = {name: imports(name) for name in MODULES}
    assert "fastbatch._verify" in graph["fastbatch.patches._patch"]  # from package import module
    assert "fastbatch._names" in graph["fastbatch._kernels"]  # a package's __init__
    assert "fastbatch._runner_report" in graph["fastbatch.vllm_plugin"]  # in a function
    assert "fastbatch._fingerprint" in graph["fastbatch.patches._patch"]  # from module import name


def test_no_module_imports_itself_through_others():
    graph = {name: imports(name) for name in MODULES}
    assert cycles(graph) == []


def test_no_piece_imports_another_piece():
    pieces = {f"fastbatch.patches.{name}" for name in registry.NAMES}
    assert pieces <= MODULES.keys()
    found = {piece: sorted(imports(piece) & (pieces - {piece})) for piece in sorted(pieces)}
    assert {piece: others for piece, others in found.items() if others} == {}
