"""Benchmark fixtures: the compiled floor kernel and one grid state at a time;
the ``ci`` marker of the benchmarks that CI runs untimed."""

import warnings

import pytest

# Warnings are errors, but the import-time deprecation noise of torch,
# transformers and vLLM is not ours to fix: import them quietly first.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import states  # noqa: F401

# CI (tox -e vllm: pytest benchmarks -m ci --benchmark-disable) runs fastbatch's
# variants on the small cells, each still checked against stock vLLM; tox -e
# bench-micro times every variant over the whole grid.  A benchmark is marked
# ``ci`` unless one of its parameters is another variant, or a cell with more
# requests or a longer output than these.
CI_VARIANTS = frozenset({"fastbatch", "verify", "sampled"})
CI_MAX_REQUESTS = 256
CI_MAX_OUTPUT_LEN = 4000


def _in_ci(name, value) -> bool:
    if name == "variant":
        return value in CI_VARIANTS
    requests = value if name == "requests" else getattr(value, "requests", 0)
    return requests <= CI_MAX_REQUESTS and getattr(value, "output_len", 0) <= CI_MAX_OUTPUT_LEN


def pytest_collection_modifyitems(items):
    for item in items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if all(_in_ci(name, value) for name, value in params.items()):
            item.add_marker(pytest.mark.ci)


@pytest.fixture(scope="session")
def floor_module():
    """benchmarks/floor.pyx, compiled on first use with the interpreter's flags."""
    import pyximport

    importers = pyximport.install(language_level=3, inplace=False)
    try:
        import floor
    finally:
        pyximport.uninstall(*importers)
    return floor


@pytest.fixture(scope="session")
def floor_update(floor_module):
    return floor_module.floor_update


@pytest.fixture(scope="session")
def spec_floor_update(floor_module):
    """The spec floor as a method, like the other variants."""
    def method(batch, draft_token_ids):
        floor_module.spec_floor_update(batch.req_ids, batch.prev_req_id_to_index,
                                       batch.sampling_metadata.spec_token_ids,
                                       draft_token_ids)
    return method


@pytest.fixture(scope="session")
def grid_state():
    """``grid_state(cell)``: the State of ``cell``, built once; the previous
    cell's State is dropped (the large ones hold gigabytes)."""
    from states import State

    current = {}

    def get(cell):
        if cell not in current:
            current.clear()
            current[cell] = State(cell)
        return current[cell]

    return get
