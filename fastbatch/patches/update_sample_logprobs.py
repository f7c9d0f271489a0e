"""Patch: ``vllm.v1.engine.logprobs.LogprobsProcessor._update_sample_logprobs``.

What is replaced: the output processor's method that appends a request's
sample logprobs of one step (token ids, logprobs, ranks and decoded texts) to
its logprobs. One compiled method (``fastbatch.update_sample_logprobs``) with
a table of texts read ahead in ``OutputProcessor.__init__``. vLLM 0.32.0 to
0.34.0.

Guard: the fingerprints of the method and its companions; the activation check
on processors of a byte-level tokenizer with U+FFFD; the shadow runs vLLM's
method on a copy.

When it can go: if vLLM caches the per-id texts itself and builds the entries
without a Python loop per logprob.

Upstream: vllm-project/vllm#57442 (open: a sampled-token logprob fast path)
and #14300 (open: logprobs' cost).

Story and numbers: ``docs/pieces/update_sample_logprobs.md``.
"""

from __future__ import annotations

import copy
import logging
import sys
import time
from typing import Any

from fastbatch import registry
from fastbatch.patches import _texts
from fastbatch.patches._patch import Patch, Shadow
from fastbatch.patches._texts import (
    MODULE,
    POOL_FACTORY,
    ByteTokenizer,
    convert,
    texts_of,
    tokenizer_entry,
)

GROUP = "front end"  # fastbatch.registry.GROUPS

logger = logging.getLogger("vllm.fastbatch")

TARGET = f"{MODULE}:LogprobsProcessor._update_sample_logprobs"
# Where the texts are read ahead (``prewarm``): the output processor's
# construction, at the engine's start.
PREWARM_TARGET = "vllm.v1.engine.output_processor:OutputProcessor.__init__"
PREWARM_FINGERPRINTS = {
    "adb0c9b5d13052495190cefd172642c44ffcfdab5195a429e63d03e3aee7ea0b":
        "vLLM 0.32.0-0.33.0",
}
VERIFIED_FINGERPRINTS = {
    "d4450b8bd306cd3377da71bb0573b7a911541d18e6dda48af88be2cafd88fe69":
        "vLLM 0.32.0-0.33.0",
}
COMPANION_FINGERPRINTS = {
    f"{MODULE}:LogprobsProcessor._verify_tokens": {
        "bc6c287ff14be31b981113ce655654886cb87d65d5e978dc3a41defdc0748a52":
            "vLLM 0.32.0-0.33.0"},
    f"{MODULE}:LogprobsProcessor._get_sampled_context_ids": {
        "f5862e97e97df96df21add90ace78b80bf40e8e468e3a7300ae86ffb345d822e":
            "vLLM 0.32.0-0.33.0"},
    "vllm.logprobs:append_logprobs_for_next_position": {
        "38b9b7c5119c251bbd5dcb0a8a8492bedbd035e42e4ae146340d8290656afe54":
            "vLLM 0.32.0-0.33.0"},
    "vllm.logprobs:FlatLogprobs.append_fast": {
        "d56e82b3697564f5e49144640d3813611d07a494cd7b90a32c0d6120bb406f2c":
            "vLLM 0.32.0-0.33.0"},
    "vllm.tokenizers.detokenizer_utils:convert_ids_list_to_tokens": {
        "fed8da48c1494b30d707c9fd55e217e2f8cc484faae1de31c90ca11cb52f4f9b":
            "vLLM 0.32.0-0.33.0"},
    f"{MODULE}:LogprobsProcessor._correct_decoded_token": {
        "dad9ddbe0945fb4ba0668e3c1d32797725e841d491c49ded680eb1a4947e2db3":
            "vLLM 0.32.0-0.33.0"},
    POOL_FACTORY: {
        "5951034387bbf8d5a4427402a1139fe597eaf616888abb90f19cfadf69857f1d":
            "vLLM 0.32.0-0.33.0"},
}
FLAT_LISTS = ("start_indices", "end_indices", "token_ids", "logprobs", "ranks",
              "decoded_tokens")

def _output_processor_type() -> type:
    return sys.modules[PREWARM_TARGET.partition(":")[0]].OutputProcessor


def _stock_init() -> Any:
    """vLLM's ``OutputProcessor.__init__``: the patch's original while
    applied, else the class's (the activation check runs before)."""
    return PREWARM_PATCH.original() or _output_processor_type().__init__


def _output_processor_init(self: Any, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
    """vLLM's ``OutputProcessor.__init__``, then the texts of the processor's
    tokenizer read ahead (``prewarm``): at the engine's start, not on the
    first steps.  (Installed only with ``PATCH``; after a divergence that
    ``FASTBATCH_VERIFY`` found, the piece runs vLLM's code, and nothing is
    read.)"""
    _stock_init()(self, tokenizer, *args, **kwargs)
    if not PATCH.piece_diverged:
        started = time.perf_counter()
        read = _texts.prewarm(self.tokenizer)
        if read:
            logger.info("fastbatch: read the texts of %d token ids ahead in %.0f ms "
                        "(update_sample_logprobs)", read,
                        (time.perf_counter() - started) * 1e3)


def _kinds() -> tuple[type, type]:
    """(Logprob, FlatLogprobs) of this vLLM."""
    logprobs = sys.modules["vllm.logprobs"]
    return logprobs.Logprob, logprobs.FlatLogprobs


def _stock_method() -> Any:
    """vLLM's method: the patch's original while applied, else the class's."""
    original = PATCH.original()
    if original is not None:
        return original
    return sys.modules[MODULE].LogprobsProcessor._update_sample_logprobs


# The piece in use: the compiled one, or its twin where it cannot be imported
# (then the plugin leaves vLLM stock anyway): its module, by this module's
# name (the package exports the function of the same name).
_piece = registry.implementation(__name__.rpartition(".")[2])

# fastbatch's drop-in for ``LogprobsProcessor._update_sample_logprobs``: the
# compiled function itself, bound on vLLM's class (no Python frame before the
# compiled call), with vLLM's signature.  ``bind()`` gives it vLLM's method,
# the tables (``tokenizer_entry``), vLLM's module and the kinds.
_update_sample_logprobs = _piece.update


def bind(stock: Any = None) -> None:
    """Bind ``_update_sample_logprobs`` to ``stock`` (by default vLLM's own
    method), the per-tokenizer tables, the first-sight texts (``convert``)
    and ``(Logprob, FlatLogprobs)``."""
    _piece.bind(stock or _stock_method(), tokenizer_entry, convert, _kinds())


# ---------------------------------------------------------------------------
# The activation check (the tokenizer that makes U+FFFD: ``ByteTokenizer``).

def _processors(flat: bool, num_logprobs: int, tokenizer: Any) -> Any:
    processor_type = sys.modules[MODULE].LogprobsProcessor
    logprobs = sys.modules["vllm.logprobs"]
    return processor_type(tokenizer=tokenizer, logprobs=logprobs.create_sample_logprobs(flat),
                          prompt_logprobs=None, cumulative_logprob=0.0,
                          num_logprobs=num_logprobs, num_prompt_logprobs=None)


def _synthetic_steps() -> list[tuple[bool, int, bool, list[tuple[Any, ...]]]]:
    """(flat, num_logprobs, with a tokenizer, steps): each step the arrays of
    one call: U+FFFD texts with and without context, the sampled token among
    the top ones, a batch wider than the request, several positions, -inf."""
    import numpy as np

    def step(ids: list[list[int]], values: list[list[float]], ranks: list[int],
             id_type: Any = np.int32) -> tuple[Any, ...]:
        return (np.array(ids, dtype=id_type), np.array(values, dtype=np.float32),
                np.array(ranks, dtype=np.int64), None)

    steps = [
        step([[0xC3, 0xC3, 65]], [[-0.5, -0.5, -1.25]], [1]),
        step([[0xA9, 256, 0xE2]], [[-0.1, -2.0, -3.0]], [2]),
        step([[258, 0x82, 257], [0xAC, 0xAC, 66]], [[-1.0, -0.2, -0.3], [-0.01, -0.01, -np.inf]],
             [3, 1], np.int64),
        step([[0xF0, 0x9F, 0x98]], [[-7.5, -0.5, -0.75]], [40]),
        step([[0x80, 0x41, 0x42], [0x41, 0x80, 0x42], [300, 0x42, 0x41]],
             [[-0.3, -0.2, -0.9], [-0.2, -0.3, -0.9], [-1.5, -0.1, -0.2]], [2, 1, 5]),
        step(np.zeros((0, 3), dtype=np.int32), np.zeros((0, 3), dtype=np.float32),
             []),
    ]
    return [(flat, num_logprobs, with_tokenizer, steps)
            for flat in (False, True) for num_logprobs in (0, 1, 2, -1)
            for with_tokenizer in (True, False)]


def logprobs_outcome(processor: Any, start: tuple[int, int]) -> tuple[Any, ...]:
    """The positions appended since ``start`` (positions, flat entries) and
    the cumulative logprob, in a comparable, picklable form (floats as
    their hex, so that equal means bit for bit, NaN and -0.0 included)."""
    def exact(value: Any) -> Any:
        return (type(value).__name__, value.hex() if type(value) is float else value)

    container = processor.logprobs
    positions, entries = start
    if type(container) is list:
        appended = [(type(entry).__name__, [
            (exact(token), type(logprob).__name__, exact(logprob.logprob),
             exact(logprob.rank), exact(logprob.decoded_token))
            for token, logprob in entry.items()]) for entry in container[positions:]]
    else:
        appended = [(name, [exact(value) for value in getattr(container, name)[
            positions if name.endswith("_indices") else entries:]]) for name in FLAT_LISTS]
    return type(container).__name__, appended, exact(processor.cumulative_logprob)


def _start(container: Any) -> tuple[int, int]:
    if type(container) is list:
        return len(container), 0
    return len(container.start_indices), len(container.logprobs)


def activation_check(method: Any, replacement: Any) -> str | None:
    """Run both on the synthetic processors; why the logprobs differ, or None."""
    bind(method)
    for flat, num_logprobs, with_tokenizer, steps in _synthetic_steps():
        tokenizer = ByteTokenizer() if with_tokenizer else None
        stock = _processors(flat, num_logprobs, tokenizer)
        ours = _processors(flat, num_logprobs, ByteTokenizer() if with_tokenizer else None)
        for arrays in steps:
            expected_start, got_start = _start(stock.logprobs), _start(ours.logprobs)
            method(stock, arrays)
            replacement(ours, arrays)
            expected = logprobs_outcome(stock, expected_start)
            got = logprobs_outcome(ours, got_start)
            if got != expected:
                return (f"flat={flat} num_logprobs={num_logprobs} tokenizer="
                        f"{with_tokenizer}: fastbatch gave {got}, vLLM gave {expected}")
    return None


# ---------------------------------------------------------------------------
# The shadow check.

def copy_container(container: Any) -> Any:
    """A container vLLM's method can append to without touching ``container``
    (its entries already there are only read: shared)."""
    if type(container) is list:
        return list(container)
    duplicate = copy.copy(container)
    for name in FLAT_LISTS:
        setattr(duplicate, name, list(getattr(container, name)))
    return duplicate


def _snapshot(processor: Any, logprobs_lists: Any) -> dict[str, Any]:
    stand_in = copy.copy(processor)
    stand_in.logprobs = copy_container(processor.logprobs)
    return {"processor": stand_in, "logprobs_lists": logprobs_lists,
            "start": _start(processor.logprobs)}


def _run(method: Any, inputs: dict[str, Any]) -> tuple[Any, ...]:
    """``method`` on a fresh copy of the snapshot's processor: its outcome."""
    processor = copy.copy(inputs["processor"])
    processor.logprobs = copy_container(processor.logprobs)
    result = method(processor, inputs["logprobs_lists"])
    return result, logprobs_outcome(processor, inputs["start"])


def _outcome(inputs: dict[str, Any], result: Any, processor: Any,
             logprobs_lists: Any) -> tuple[Any, ...]:
    return result, logprobs_outcome(processor, inputs["start"])


def _compare(ours: tuple[Any, ...], stock: tuple[Any, ...]) -> str | None:
    if ours[0] != stock[0]:
        return f"fastbatch returned {ours[0]!r}, vLLM {stock[0]!r}"
    if ours[1] != stock[1]:
        return f"fastbatch appended {ours[1]!r}, vLLM {stock[1]!r}"
    return None


def _restore(inputs: dict[str, Any], stock: tuple[Any, ...], result: Any, processor: Any,
             logprobs_lists: Any) -> Any:
    """fastbatch's positions taken out again, then vLLM's method on the processor."""
    container = processor.logprobs
    positions, entries = inputs["start"]
    if type(container) is list:
        del container[positions:]
    else:
        for name in FLAT_LISTS:
            del getattr(container, name)[positions if name.endswith("_indices") else entries:]
    processor.cumulative_logprob = inputs["processor"].cumulative_logprob
    return _stock_method()(processor, logprobs_lists)


SHADOW = Shadow(snapshot=_snapshot, run=_run, outcome=_outcome, restore=_restore,
                compare=_compare)

PATCH = Patch(TARGET, _update_sample_logprobs, fingerprints=VERIFIED_FINGERPRINTS,
              companions=COMPANION_FINGERPRINTS, activation_check=activation_check,
              shadow=SHADOW)


# ---------------------------------------------------------------------------
# The texts read ahead: the activation check and the patch.

def _state(processor: Any) -> dict[str, Any]:
    """An output processor's attributes, comparable: the tokenizer by
    identity (vLLM's calls may cache things on it), each other object that
    compares by identity by its type and attributes."""
    def comparable(value: Any) -> Any:
        if type(value).__eq__ is object.__eq__ and hasattr(value, "__dict__"):
            return type(value), {name: comparable(item) for name, item in vars(value).items()}
        return value
    return {name: id(value) if name == "tokenizer" else comparable(value)
            for name, value in vars(processor).items()}


def prewarm_activation_check(method: Any, replacement: Any) -> str | None:
    """vLLM's ``OutputProcessor.__init__`` and fastbatch's build the same
    processor (with and without a tokenizer; one with nothing to read ahead,
    so that the check logs nothing), and ``prewarm`` puts vLLM's first-sight
    text of every id up to ``max_token_id`` in a new tokenizer's table (the
    ids above it left to first sight); why not, or None."""
    processor_type = _output_processor_type()
    convert = sys.modules[MODULE].convert_ids_list_to_tokens
    unread = ByteTokenizer()
    unread.max_token_id = None
    for tokenizer in (unread, None):
        built = []
        for init in (method, replacement):
            processor = object.__new__(processor_type)
            init(processor, tokenizer, log_stats=False, stream_interval=2)
            built.append(_state(processor))
        if built[0] != built[1]:
            return f"fastbatch built {built[1]}, vLLM built {built[0]}"
    tokenizer = ByteTokenizer()
    read = _texts.prewarm(tokenizer)
    expected = {token_id: convert(tokenizer, [token_id])[0]
                for token_id in range(tokenizer.max_token_id + 1)}
    texts = texts_of(tokenizer)
    if read != len(expected) or texts != expected:
        return f"prewarm read {read} texts {texts}, vLLM's first-sight texts are {expected}"
    return None


# Nothing of the construction to check (snapshot None): the texts read ahead
# are compared on each checked call of ``update_sample_logprobs`` (SHADOW),
# whose vLLM method decodes through the tokenizer itself.
PREWARM_SHADOW = Shadow(snapshot=lambda *args, **kwargs: None,
                        run=lambda function, inputs: None,
                        outcome=lambda *args, **kwargs: None,
                        restore=lambda *args, **kwargs: None)

# The texts are read ahead with the code the piece's method relies on
# (``convert_ids_list_to_tokens``, the pool): its companions.  (Not the method:
# installed, it is the compiled one.)
PREWARM_PATCH = Patch(PREWARM_TARGET, _output_processor_init,
                      fingerprints=PREWARM_FINGERPRINTS, companions=COMPANION_FINGERPRINTS,
                      activation_check=prewarm_activation_check, shadow=PREWARM_SHADOW,
                      requires=PATCH)

PATCHES = (PATCH, PREWARM_PATCH)
