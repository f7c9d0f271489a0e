"""The registry: every piece is one name carried by its files, its compiled
module and its pure-Python twin agree in what they offer and how it is
called, and everything that lists the pieces lists the same ones."""

import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest

import fastbatch
from fastbatch import _kernels, _reference, registry
from fastbatch._counters import combined

ROOT = Path(__file__).resolve().parent.parent


def _public_functions(module):
    """The module's own public functions (not what it imports; a twin's
    ``stats``/``reset_stats`` are bound methods of its counters)."""
    return {name: value for name, value in vars(module).items()
            if not name.startswith("_") and callable(value) and not isinstance(value, type)
            and (getattr(value, "__module__", None) == module.__name__
                 or inspect.ismethod(value))}


def _shape(function):
    """A signature without annotations: names, kinds, defaults."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def test_the_pieces_are_the_public_patch_modules():
    found = sorted(path.stem for path in (ROOT / "fastbatch" / "patches").glob("[!_]*.py"))
    assert found, "no patch module found in fastbatch/patches"
    assert list(registry.NAMES) == found == sorted(_kernels.PIECES) == sorted(_reference.PIECES)


@pytest.mark.parametrize("name", registry.NAMES)
def test_every_piece_has_its_files_under_its_one_name(name):
    for path in (f"fastbatch/patches/{name}.py", f"fastbatch/_kernels/{name}.pyx",
                 f"fastbatch/_kernels/{name}.pyi", f"fastbatch/_reference/{name}.py",
                 f"tests/test_{name}.py"):
        assert (ROOT / path).is_file(), path


def test_no_file_outside_the_registry_claims_a_piece():
    for folder, pattern in (("fastbatch/_kernels", "[!_]*.pyx"),
                            ("fastbatch/_kernels", "[!_]*.pyi"),
                            ("fastbatch/_reference", "[!_]*.py")):
        names = {path.stem for path in (ROOT / folder).glob(pattern)} - {"__init__"}
        assert names == set(registry.NAMES), folder


@pytest.mark.parametrize("name", registry.NAMES)
def test_kernel_and_twin_have_the_same_functions_and_signatures(name):
    """As cytoolz's test_embedded_sigs: the compiled module and its twin offer
    the same public functions, called the same way (annotations aside)."""
    kernel, twin = _kernels.PIECES[name], _reference.PIECES[name]
    assert fastbatch.COMPILED and kernel.__file__.endswith(".so")
    assert kernel.__all__ == twin.__all__
    kernel_functions, twin_functions = _public_functions(kernel), _public_functions(twin)
    assert kernel_functions.keys() == twin_functions.keys()
    assert {"stats", "reset_stats", *kernel.__all__} <= kernel_functions.keys()
    for function in kernel_functions:
        assert _shape(kernel_functions[function]) == _shape(twin_functions[function]), function


@pytest.mark.parametrize("name", registry.NAMES)
def test_kernel_and_twin_count_the_same_things(name):
    kernel, twin = _kernels.PIECES[name], _reference.PIECES[name]
    for piece in (kernel, twin):
        piece.reset_stats()
        assert set(piece.stats().values()) == {0}
    assert kernel.stats().keys() == twin.stats().keys()
    assert all(not key.startswith(name) for key in kernel.stats())  # nested, not prefixed


def test_stats_are_nested_by_piece():
    for implementation in (fastbatch, _kernels, _reference):
        implementation.reset_stats()
        counters = implementation.stats()
        assert list(counters) == list(registry.NAMES)
        assert all(set(piece.values()) == {0} for piece in counters.values())


def test_the_package_exports_every_pieces_functions():
    exported = [name for piece in _kernels.PIECES.values() for name in piece.__all__]
    assert len(exported) == len(set(exported))
    assert set(fastbatch.__all__) == {"COMPILED", "__version__", "stats", "reset_stats",
                                      *exported}
    for name in exported:
        assert getattr(fastbatch, name) is getattr(_kernels, name)
        assert getattr(_reference, name) is not getattr(_kernels, name)


def test_reset_stats_of_named_pieces_leaves_the_others():
    counts = {"a": {"calls": 3}, "b": {"calls": 5}}
    modules = {name: SimpleNamespace(stats=lambda name=name: dict(counts[name]),
                                     reset_stats=lambda name=name: counts[name].update(calls=0))
               for name in counts}
    stats, reset_stats = combined(modules)
    reset_stats("b")
    assert stats() == {"a": {"calls": 3}, "b": {"calls": 0}}
    with pytest.raises(KeyError, match="no fastbatch piece"):
        reset_stats("c")
    assert stats() == {"a": {"calls": 3}, "b": {"calls": 0}}  # checked before resetting
    reset_stats()
    assert stats() == {"a": {"calls": 0}, "b": {"calls": 0}}


@pytest.mark.parametrize("name", registry.NAMES)
def test_the_implementation_in_use_is_the_packages(name):
    expected = (_kernels if fastbatch.COMPILED else _reference).PIECES[name]
    assert registry.implementation(name) is expected
    assert all(getattr(fastbatch, function) is getattr(expected, function)
               for function in expected.__all__)


def test_an_unknown_implementation_is_a_clear_error():
    with pytest.raises(KeyError, match="no fastbatch piece 'output'"):
        registry.implementation("output")


@pytest.mark.vllm
def test_each_piece_is_in_the_group_of_its_targets():
    """The scheduler's pieces replace code of ``vllm.v1.core``, the front end's
    of ``vllm.v1.engine`` and ``vllm.entrypoints``, the runner's neither."""
    where = {"scheduler": ("vllm.v1.core.",), "front end": ("vllm.v1.engine.",
                                                            "vllm.entrypoints."),
             "runner": ()}
    grouped = [name for group in registry.GROUPS for name in registry.group(group)]
    assert sorted(grouped) == list(registry.NAMES)
    for group in registry.GROUPS:
        for name in registry.group(group):
            piece = registry.piece(name)
            assert piece.group == group
            assert piece.main.acts_under_v2 == (group != "runner"), name
            if where[group]:
                assert piece.main.module.startswith(where[group]), name
    with pytest.raises(KeyError, match="no group 'engine'"):
        registry.group("engine")


def test_deprecated_names_point_at_pieces_and_are_not_pieces():
    assert set(registry.DEPRECATED_NAMES.values()) <= set(registry.NAMES)
    assert not set(registry.DEPRECATED_NAMES) & set(registry.NAMES)


def test_an_unknown_piece_is_a_clear_error():
    with pytest.raises(KeyError, match="no fastbatch piece 'output'"):
        registry.piece("output")
