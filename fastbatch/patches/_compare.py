"""Generic comparison for the pieces' shadows (``FASTBATCH_VERIFY``), their
activation checks and the tests: any value as comparable, picklable data
(``plain``), and where two values first differ (``first_difference``)."""

from __future__ import annotations

import collections
import collections.abc
import copy
import dataclasses
import enum
import itertools
import weakref
from array import array
from typing import Any


def plain(value: Any, depth: int = 0) -> Any:
    """``value`` as comparable, picklable data (KV blocks by id, requests by id)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, enum.Enum)):
        return value
    if isinstance(value, array):  # vLLM 0.34's TokenBuffer
        return (type(value).__qualname__, value.typecode, value.tolist())
    if depth > 24:
        return ("too deep", type(value).__qualname__)
    depth += 1
    if type(value) is list:
        if all(type(item) is int for item in value):
            return list(value)
        return [plain(item, depth) for item in value]
    if isinstance(value, (list, tuple, collections.deque)):
        return (type(value).__qualname__, [plain(item, depth) for item in value])
    if isinstance(value, dict):
        return (type(value).__qualname__,
                [(plain(key, depth), plain(item, depth)) for key, item in value.items()])
    if isinstance(value, (set, frozenset)):
        return ("set", sorted(repr(plain(item, depth)) for item in value))
    block_id = getattr(value, "block_id", None)
    if type(block_id) is int:
        return ("block", block_id)
    request_id = getattr(value, "request_id", None)
    if type(request_id) is str and hasattr(value, "_all_token_ids"):
        return ("request", request_id)
    fields = getattr(type(value), "__struct_fields__", None)
    if fields is not None:
        return (type(value).__qualname__,
                {name: plain(getattr(value, name), depth) for name in fields})
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__qualname__,
                {field.name: plain(getattr(value, field.name), depth)
                 for field in dataclasses.fields(value)})
    if (hasattr(value, "tobytes") and hasattr(value, "strides")
            and not getattr(getattr(value, "dtype", None), "hasobject", True)):
        # numpy, exactly: dtype, shape, strides and bytes (a NaN equals itself)
        return (type(value).__qualname__, value.dtype.str, value.shape, value.strides,
                value.tobytes())
    if hasattr(value, "tolist") and hasattr(value, "dtype"):
        return (type(value).__qualname__, str(value.dtype), value.tolist())
    if isinstance(value, collections.abc.Iterator):
        return ("iterator", [plain(item, depth) for item in value])
    if hasattr(value, "__dict__") and not callable(value):
        return (type(value).__qualname__,
                {name: plain(item, depth) for name, item in vars(value).items()})
    return (type(value).__qualname__, repr(value))


def equal(ours: Any, stock: Any) -> bool:
    """``ours == stock`` and of one type (containers holding arrays, where
    ``==`` is elementwise or ambiguous: as plain data)."""
    if type(ours) is not type(stock):
        return False
    try:
        return bool(ours == stock)
    except Exception:  # arrays inside: compare as plain data
        return plain(ours) == plain(stock)


def first_difference(ours: Any, stock: Any, path: str = "") -> str | None:
    """Where fastbatch's ``ours`` and vLLM's ``stock`` first differ (a path
    into them, and both values there), or None where they are ``equal``.
    A dict's string keys extend the path as ``.key``, other keys and list
    indices as subscripts; a difference is always reported, at the
    outermost place if no part differs on its own."""
    if equal(ours, stock):
        return None
    where = path or "outcome"
    if type(ours) is not type(stock):
        return f"{where}: fastbatch {ours!r:.300}, vLLM {stock!r:.300}"
    if hasattr(type(ours), "__struct_fields__"):
        found = first_difference(plain(ours)[1], plain(stock)[1], path)
    elif isinstance(ours, dict):
        found = _first_in_dict(ours, stock, path)
    elif isinstance(ours, (list, tuple)):
        found = _first_in_list(ours, stock, path)
    else:
        found = None
    return found or f"{where}: fastbatch {ours!r:.300}, vLLM {stock!r:.300}"


def _first_in_list(ours: Any, stock: Any, path: str) -> str | None:
    """Item by item; a sequence of (key, value) pairs with distinct keys (a
    mapping, in order, as ``plain`` gives it) by key."""
    pairs = all(type(item) is tuple and len(item) == 2 for item in (*ours, *stock)) and all(
        len({repr(key) for key, _ in items}) == len(items) for items in (ours, stock))
    for index, (left, right) in enumerate(zip(ours, stock, strict=False)):
        if pairs and equal(left[0], right[0]):
            found = first_difference(left[1], right[1], f"{path}[{left[0]!r}]")
        else:
            found = first_difference(left, right, f"{path}[{index}]")
        if found is not None:
            return found
    if len(ours) != len(stock):
        return f"{path or 'outcome'}: {len(ours)} items in fastbatch's, {len(stock)} in vLLM's"
    return None


def _first_in_dict(ours: dict[Any, Any], stock: dict[Any, Any], path: str) -> str | None:
    for key in [*ours, *(key for key in stock if key not in ours)]:
        where = f"{path}.{key}" if type(key) is str else f"{path}[{key!r}]"
        if key not in ours or key not in stock:
            return f"{where}: only in {'fastbatch' if key in ours else 'vLLM'}'s"
        found = first_difference(ours[key], stock[key], where)
        if found is not None:
            return found
    if list(ours) != list(stock):
        return f"{path or 'outcome'} keys: fastbatch {list(ours)!r:.300}, vLLM {list(stock)!r:.300}"
    return None


def rows_problem(ours: Any, stock: list[list[int]]) -> str | None:
    """Why ``ours`` is not exactly vLLM's ``stock`` rows (``tolist()``
    rows), or None: the same values, as a plain ``list`` of distinct plain
    ``list``s of plain ``int``s.  Distinct, because vLLM's callers change
    rows in place (``clear()``, truncation)."""
    if (type(ours) is list and ours == stock and set(map(type, ours)) <= {list}
            and set(map(type, itertools.chain.from_iterable(ours))) <= {int}
            and len(set(map(id, ours))) == len(ours)):
        return None  # the common case, at C speed
    if type(ours) is not list:
        return f"fastbatch gave a {type(ours).__name__}, not a list"
    if len(ours) != len(stock):
        return f"fastbatch gave {len(ours)} rows, vLLM {len(stock)}"
    for index, (got, expected) in enumerate(zip(ours, stock, strict=True)):
        if type(got) is not list or got != expected or any(
                type(item) is not int for item in got):
            return f"row {index}: fastbatch gave {got!r}, vLLM {expected!r}"
    return "fastbatch gave two rows that are one list object"


def tensor_copy(tensor: Any) -> Any:
    """A copy of an ids tensor (or array) that later writes to it do not reach."""
    return tensor.clone() if hasattr(tensor, "clone") else copy.deepcopy(tensor)


def unchanged(live: Any, saved: Any) -> bool:
    """Whether the ids tensor (or array) ``live`` still holds ``saved``'s values."""
    import numpy as np
    import torch

    if isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor):
        return (live.shape == saved.shape and live.dtype == saved.dtype
                and bool(torch.equal(live, saved.to(live.device))))
    return bool(np.array_equal(live, saved))


class NoWait:
    """The copy-ready event of a replayed reproducer: the data are already there."""

    def synchronize(self) -> None:
        pass


# ---------------------------------------------------------------------------
# Shadows of the scheduler's pieces: vLLM requests copied so that vLLM's code
# can change them freely, their state as compared, and a copy of a KV-cache
# manager whose block pool only records what it is asked.

# Request attributes vLLM's method may change in place: copied for the shadow
# (the rest of a request is shared with its copy and compared by identity).
COPIED_LISTS = ("_output_token_ids", "_all_token_ids", "block_hashes", "events",
                 "spec_token_ids")
COPIED_DEEP = ("prefill_stats", "spec_decode_metrics", "streaming_queue",
                "_prompt_embeds_per_block_hashes")
TOKEN_LISTS = ("_output_token_ids", "_all_token_ids", "block_hashes")
VIEWS = {"output_token_ids": "_output_token_ids", "all_token_ids": "_all_token_ids"}
SCALAR_TYPES = frozenset((type(None), bool, int, float, str, bytes))
_HASHER = "vllm request_block_hasher"
_HASHERS: dict[tuple[Any, ...], Any] = {}


class BlockRef:
    """A KV-cache block of the shadow's copy of the manager: its id only."""

    __slots__ = ("block_id",)

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id


class BlockPoolProbe:
    """The block pool of the shadow's copy of the KV-cache manager: the pool's
    settings, and a record of every call made to it (none is carried out)."""

    SETTINGS = ("num_gpu_blocks", "medium", "enable_caching", "hash_block_size",
                "num_hash_lookahead_tokens", "enable_kv_cache_events")

    def __init__(self, pool: Any) -> None:
        for name in self.SETTINGS:
            if hasattr(pool, name):
                setattr(self, name, getattr(pool, name))
        self.calls: list[Any] = []

    def take_events(self) -> list[Any]:
        return []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in self.SETTINGS or name == "calls":
            raise AttributeError(name)

        def record(*args: Any, **kwargs: Any) -> None:
            self.calls.append((name, plain(args), plain(kwargs)))

        return record


def _same(block: Any) -> Any:
    return block


def _block_ref(block: Any) -> BlockRef:
    return block if type(block) is BlockRef else BlockRef(block.block_id)


def kv_probe(manager: Any, request_ids: Any = None, detach: bool = False) -> Any:
    """A copy of the KV-cache manager (of ``request_ids``' part of it, or all
    of a probe's) whose block pool only records: what vLLM's ``cache_blocks``
    and ``free`` would change is seen in the copy, nothing in vLLM's own.  The
    copy's block tables hold the very blocks (the calls that would change
    them are only recorded), or with ``detach`` their ids (for pickling)."""
    block_ref = _block_ref if detach else _same
    live_pool = manager.block_pool
    pool = BlockPoolProbe(live_pool)
    probe = copy.copy(manager)
    probe.block_pool = pool
    if getattr(probe, "metrics_collector", None) is not None:
        probe.metrics_collector = None
    coordinator = copy.copy(manager.coordinator)
    coordinator.block_pool = pool
    singles = []
    for single in manager.coordinator.single_type_managers:
        clone = copy.copy(single)
        state = vars(clone)
        for name, value in list(state.items()):
            if value is live_pool:
                state[name] = pool
            elif type(getattr(value, "block_id", None)) is int:  # the null block
                state[name] = value = copy.copy(value)
                for link in ("prev_free_block", "next_free_block"):
                    if hasattr(value, link):
                        setattr(value, link, None)  # not the free queue's chain
                owner = getattr(value, "pool", None)
                if owner is live_pool:
                    value.pool = pool
                elif isinstance(owner, weakref.ref) and owner() is live_pool:  # vLLM 0.34
                    value.pool = None if detach else weakref.ref(pool)
            elif type(value) is list:
                state[name] = []  # records of this step (new blocks, pending copies)
        blocks, cached = single.req_to_blocks, single.num_cached_block
        partial = getattr(single, "_partial_hit_reqs", {})
        ids = list(blocks) if request_ids is None else request_ids
        clone.req_to_blocks = collections.defaultdict(list, {
            rid: [block_ref(block) for block in blocks[rid]] if detach else list(blocks[rid])
            for rid in ids if rid in blocks})
        ids = list(cached) if request_ids is None else request_ids
        clone.num_cached_block = {rid: cached[rid] for rid in ids if rid in cached}
        if hasattr(single, "_partial_hit_reqs"):
            ids = list(partial) if request_ids is None else request_ids
            clone._partial_hit_reqs = {rid: (partial[rid][0], block_ref(partial[rid][1]))
                                       for rid in ids if rid in partial}
        singles.append(clone)
    coordinator.single_type_managers = tuple(singles)
    probe.coordinator = coordinator
    return probe


def kv_view(manager: Any, request_ids: list[str]) -> Any:
    """Per single-type manager, what it keeps of each request: cached block
    count, block ids, partial hit."""
    view = []
    for single in manager.coordinator.single_type_managers:
        blocks, partial = single.req_to_blocks, getattr(single, "_partial_hit_reqs", {})
        view.append({rid: (single.num_cached_block.get(rid),
                           [block.block_id for block in blocks[rid]] if rid in blocks else None,
                           plain(partial.get(rid)))
                     for rid in request_ids})
    return view


def kv_calls(manager: Any) -> list[Any]:
    """What the shadow's copy of the KV-cache manager was asked to do."""
    calls = list(manager.block_pool.calls)
    for index, single in enumerate(manager.coordinator.single_type_managers):
        for name, value in vars(single).items():
            if type(value) is list and value:
                calls.append((f"group {index} {name}", plain(value)))
    return calls


def hasher_description(hasher: Any) -> Any:
    """vLLM's block hasher as picklable data (rebuilt on replay), or as is."""
    code = getattr(hasher, "__code__", None)
    if code is None or hasher.__closure__ is None:
        return hasher
    cells = dict(zip(code.co_freevars, [cell.cell_contents for cell in hasher.__closure__],
                     strict=True))
    if "hash_block_size" not in cells or "caching_hash_fn" not in cells:
        return hasher
    return (_HASHER, cells["hash_block_size"], cells["caching_hash_fn"],
            cells.get("num_hash_lookahead_tokens", 0))


def rebuild_hasher(description: tuple[Any, ...]) -> Any:
    hasher = _HASHERS.get(description)
    if hasher is None:
        from vllm.v1.core import kv_cache_utils

        _, block_size, hash_fn, lookahead = description
        if getattr(kv_cache_utils, "NONE_HASH", None) is None:
            kv_cache_utils.init_none_hash(hash_fn)
        hasher = (kv_cache_utils.get_request_block_hasher(block_size, hash_fn, lookahead)
                  if lookahead else kv_cache_utils.get_request_block_hasher(block_size, hash_fn))
        _HASHERS[description] = hasher
    return hasher


def copy_tokens(tokens: array) -> array:
    """A copy of an ``array`` of token ids, of its own type (``copy.copy``
    gives a plain ``array``; a subclass's constructor may take other arguments)."""
    clone = array.__new__(type(tokens), tokens.typecode)
    array.extend(clone, tokens)
    return clone


def copy_request(request: Any) -> Any:
    """A copy of ``request`` that vLLM's method can change freely: its lists
    and per-request records copied, everything else shared."""
    from vllm.v1.utils import ConstantList

    clone = copy.copy(request)
    state = vars(clone)
    for name in COPIED_LISTS:
        if type(state.get(name)) is list:
            state[name] = list(state[name])
        elif isinstance(state.get(name), array):  # a TokenBuffer: its own type
            state[name] = copy_tokens(state[name])
    for name in COPIED_DEEP:
        if state.get(name) is not None:
            state[name] = copy.deepcopy(state[name])
    for view, name in VIEWS.items():
        if view in state and isinstance(state.get(name), (list, array)):
            state[view] = ConstantList(state[name])
    hasher = state.get("_block_hasher")
    if type(hasher) is tuple and hasher[:1] == (_HASHER,):
        state["_block_hasher"] = rebuild_hasher(hasher)
    return clone


def is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, bytes, enum.Enum))


def request_state(request: Any) -> dict[str, Any]:
    """Every instance attribute of ``request``: the copied ones by value, the
    token-list views by whether they still show the request's lists, scalars
    by value, any other object by identity (it is shared with the copy)."""
    state = vars(request)
    out: dict[str, Any] = {}
    for name, value in state.items():
        if name in VIEWS:
            out[name] = getattr(value, "_x", None) is state.get(VIEWS[name])
        elif name in TOKEN_LISTS and type(value) is list:
            out[name] = list(value)  # ints (hashes: bytes): compared as they are
        elif name in TOKEN_LISTS and isinstance(value, array):
            out[name] = plain(value)
        elif name == "_block_hasher":
            continue  # read only; rebuilt on replay
        elif type(value) in SCALAR_TYPES:
            out[name] = value
        elif name in COPIED_LISTS or name in COPIED_DEEP or is_scalar(value):
            out[name] = plain(value)
        else:
            out[name] = ("the same object", id(value))
    return out
