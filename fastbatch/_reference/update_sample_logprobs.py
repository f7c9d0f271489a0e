"""Pure-Python twin of the compiled piece ``update_sample_logprobs``: the test oracle.

Same signature, rules, errors and counters as
``fastbatch._kernels.update_sample_logprobs``; written for reading, not for speed.
(The compiled call also leaves its ``Logprob`` objects and dicts untracked by
the garbage collector, which plain Python cannot do, makes no ``Logprob``
for a sampled token that a later column of its position repeats, whose entry
would be replaced, and makes a plain dataclass ``Logprob`` as its
``__init__`` would without calling it; no value differs.)
"""

from __future__ import annotations

__all__ = ["update_sample_logprobs"]

import sys
import weakref
from typing import Any

from fastbatch._reference._common import Counters

_counters = Counters(("calls", "positions", "decoded", "corrected"))
stats, reset_stats = _counters.stats, _counters.reset_stats
_stats = _counters.values

MAX_CONTEXT = 4
FLAT_LISTS = ("start_indices", "end_indices", "token_ids", "logprobs", "ranks",
              "decoded_tokens")


def _array(source: Any, ndim: int, kind: str, name: str) -> tuple[list, int, int]:
    """``source`` read as the kernel's view reads it: (rows as lists, rows, columns)."""
    try:
        view = memoryview(source)
    except TypeError as exc:
        raise TypeError(f"{name} must be a {ndim}-D numpy array, got "
                        f"{type(source).__name__} ({exc})") from None
    form = view.format.lstrip("@=" + ("<" if sys.byteorder == "little" else ""))
    forms = ("i", "l", "q") if kind == "i" else ("f", "d")
    if not (view.ndim == ndim and view.itemsize in (4, 8) and form in forms):
        kinds = "int32 or int64" if kind == "i" else "float32 or float64"
        raise TypeError(f"{name} must be a {ndim}-D {kinds} array, got a {view.ndim}-D "
                        f"array of format {view.format!r}")
    rows = view.tolist()  # float32 items widen to doubles exactly
    if ndim == 1:
        return [[item] for item in rows], len(rows), 1
    return rows, view.shape[0], view.shape[1]


def _text(texts: dict, convert: Any, tokenizer: Any, token: int) -> str:
    text = texts.get(token)
    if text is not None:
        return text
    converted = convert(tokenizer, [token])
    if type(converted) is not list or len(converted) != 1:
        raise TypeError(f"the tokenizer's texts of [{token}] must be a list of one str, "
                        f"got {converted!r}")
    text = converted[0]
    if type(text) is not str:
        raise TypeError(f"the tokenizer's text of {token} must be a str, got "
                        f"{type(text).__name__}")
    texts[token] = text
    _stats["decoded"] += 1
    return text


def _context(processor: Any, container: Any, token_ids: list, position: int) -> list[int]:
    """vLLM's ``_get_sampled_context_ids(self.logprobs)`` for ``position``:
    the container's last positions, then this call's earlier ones."""
    earlier = min(position, MAX_CONTEXT)
    context: list[int] = []
    if earlier < MAX_CONTEXT:
        context = processor._get_sampled_context_ids(container, MAX_CONTEXT - earlier)
        if type(context) is not list:
            raise TypeError(f"_get_sampled_context_ids must return a list, got "
                            f"{type(context).__name__}")
        context = list(context)
    return context + [row[0] for row in token_ids[position - earlier:position]]


# Set by bind(): (vLLM's method, the patch's per-tokenizer entry, the
# first-sight texts, kinds); the last tokenizer seen (weakly) and its entry.
_BOUND: tuple[Any, Any, Any, tuple[type, type]] | None = None
_last: tuple[Any, Any] = (None, None)


def bind(stock: Any, entry_of: Any, convert: Any, kinds: tuple[type, type]) -> None:
    """Make ``update`` answer for this vLLM: ``stock`` is vLLM's own
    ``LogprobsProcessor._update_sample_logprobs`` (it answers every call
    ``update_sample_logprobs`` does not take), ``entry_of(tokenizer)`` gives
    a tokenizer's ``(texts, correct)`` or None where it cannot key them,
    ``convert(tokenizer, ids)`` gives the texts of ids met for the first
    time (the patch's: vLLM's ``convert_ids_list_to_tokens``), ``kinds`` is
    ``(Logprob, FlatLogprobs)``."""
    global _BOUND, _last
    if not callable(stock):
        raise TypeError(f"stock must be callable, got {type(stock).__name__}")
    if not callable(entry_of):
        raise TypeError(f"entry_of must be callable, got {type(entry_of).__name__}")
    if not callable(convert):
        raise TypeError(f"convert must be callable, got {type(convert).__name__}")
    if type(kinds) is not tuple:
        raise TypeError(f"kinds must be a tuple, got {type(kinds).__name__}")
    if len(kinds) != 2:
        raise ValueError(f"kinds must be (Logprob, FlatLogprobs), got {len(kinds)} items")
    _BOUND = (stock, entry_of, convert, kinds)
    _last = (None, None)


def update(self: Any, logprobs_lists: Any) -> None:
    """fastbatch's ``LogprobsProcessor._update_sample_logprobs`` (vLLM's
    signature): ``update_sample_logprobs`` with the processor's tokenizer's
    table and corrector; vLLM's method (``bind``) where the tokenizer cannot
    key a table, or the call raises TypeError or ValueError (raised before
    anything is written)."""
    global _last
    if _BOUND is None:
        raise RuntimeError("fastbatch's update_sample_logprobs is not bound to vLLM's method "
                           "(fastbatch.patches.update_sample_logprobs.bind() does it)")
    stock, entry_of, convert, kinds = _BOUND
    tokenizer = self.tokenizer
    ref, entry = _last
    if tokenizer is None or ref is None or ref() is not tokenizer:
        entry = entry_of(tokenizer)
        if entry is not None and tokenizer is not None:
            _last = (weakref.ref(tokenizer), entry)
    if entry is not None:
        texts, correct = entry
        try:
            update_sample_logprobs(self, logprobs_lists, texts, convert, kinds, correct)
            return None
        except (TypeError, ValueError):  # checked before anything was written
            pass
    return stock(self, logprobs_lists)


def update_sample_logprobs(processor: Any, logprobs_lists: Any, texts: dict[int, str],
                           convert: Any, kinds: tuple[type, type], correct: Any = None) -> int:
    """Append the positions of ``logprobs_lists`` to ``processor.logprobs``
    and their sampled logprobs to ``processor.cumulative_logprob``.

    vLLM's ``LogprobsProcessor._update_sample_logprobs(logprobs_lists)``
    (vLLM 0.32.0 on) on the processor's instance dict.  ``logprobs_lists``
    is its ``(token ids [P, K], logprobs [P, K], sampled ranks [P], _)``;
    ``texts`` maps token ids to their text for the processor's tokenizer
    (filled here from ``convert(tokenizer, [id])``, vLLM's
    ``convert_ids_list_to_tokens``; unused without a tokenizer); ``kinds`` is
    ``(Logprob, FlatLogprobs)``.  A text that ends in U+FFFD is replaced by
    ``correct(processor, token, context)``, or without it the processor's
    own ``_correct_decoded_token``, as vLLM's ``_verify_tokens`` does, for every
    entry kept (vLLM also corrects the columns beyond a request's
    ``num_logprobs + 1`` that it then drops, and in a dict a sampled token's
    own entry where a later column repeats it and replaces its text).  The
    entries, zipped with the ranks ``(rank, 1..num_logprobs)``, are appended
    as a dict of ``Logprob`` or to the ``FlatLogprobs``.

    Anything this call cannot take as vLLM would (another container or
    dtype, no column, a non-float cumulative logprob...) is a TypeError or
    ValueError, raised before anything is written; every text is found
    before anything is written too.  Returns the number of positions
    appended.
    """
    if not isinstance(texts, dict):
        raise TypeError(f"texts must be a dict, got {type(texts).__name__}")
    if not isinstance(kinds, tuple):
        raise TypeError(f"kinds must be a tuple, got {type(kinds).__name__}")
    if len(kinds) != 2:
        raise ValueError(f"kinds must be (Logprob, FlatLogprobs), got {len(kinds)} items")
    logprob_type, flat_type = kinds
    attrs = getattr(processor, "__dict__", None)
    if type(attrs) is not dict:
        raise TypeError(f"processor must have an instance dict, got "
                        f"{type(processor).__name__}")
    num_logprobs = attrs.get("num_logprobs")
    container = attrs.get("logprobs")
    cumulative = attrs.get("cumulative_logprob")
    tokenizer = attrs.get("tokenizer")
    if type(num_logprobs) is not int:
        raise TypeError(f"num_logprobs must be an int, got {type(num_logprobs).__name__}")
    if type(cumulative) is not float:
        raise TypeError(f"cumulative_logprob must be a float, got "
                        f"{type(cumulative).__name__}")
    flat = type(container) is flat_type
    lists: list[list] = []
    if flat:
        flat_attrs = getattr(container, "__dict__", None)
        if type(flat_attrs) is not dict:
            raise TypeError("the FlatLogprobs must have an instance dict")
        lists = [flat_attrs.get(name) for name in FLAT_LISTS]
        for name, item in zip(FLAT_LISTS, lists, strict=True):
            if type(item) is not list:
                raise TypeError(f"FlatLogprobs.{name} must be a list, got "
                                f"{type(item).__name__}")
    elif type(container) is not list:
        raise TypeError(f"logprobs must be a list or FlatLogprobs, got "
                        f"{type(container).__name__}")
    if not isinstance(logprobs_lists, tuple) or len(logprobs_lists) != 4:
        raise TypeError("logprobs_lists must be a 4-tuple (token ids, logprobs, ranks, _)")
    if not -2**63 <= num_logprobs < 2**63:
        raise ValueError(f"num_logprobs = {num_logprobs} is out of range")
    token_ids, id_rows, id_cols = _array(logprobs_lists[0], 2, "i",
                                         "logprobs_lists[0] (token ids)")
    logprobs, logprob_rows, logprob_cols = _array(logprobs_lists[1], 2, "f",
                                                  "logprobs_lists[1] (logprobs)")
    ranks, rank_rows, _ = _array(logprobs_lists[2], 1, "i", "logprobs_lists[2] (sampled ranks)")
    num_positions = min(id_rows, logprob_rows, rank_rows)
    num_ranks = 1 + max(0, logprob_cols if num_logprobs == -1 else num_logprobs)
    kept = min(id_cols, logprob_cols, num_ranks)
    if num_positions > 0 and (id_cols == 0 or logprob_cols == 0):
        raise ValueError("logprobs_lists has no column: no sampled token")

    # Pass 1: every text kept (nothing of the processor is written).  In a
    # dict, a sampled token that a later column repeats keeps only that
    # column's text: vLLM's correction of its own is computed and dropped (it
    # has no effect), so it is not made here.
    decoded: list[list[str | None]] = [[None] * kept for _ in range(num_positions)]
    if tokenizer is not None:
        for p in range(num_positions):
            context = None
            for c in range(kept):
                if c == 0 and not flat and token_ids[p][0] in token_ids[p][1:kept]:
                    continue
                token = token_ids[p][c]
                text = _text(texts, convert, tokenizer, token)
                if text.endswith("\ufffd"):
                    if context is None:
                        context = _context(processor, container, token_ids, p)
                    if correct is None:
                        text = processor._correct_decoded_token(token, context)
                    else:
                        text = correct(processor, token, context)
                    _stats["corrected"] += 1
                decoded[p][c] = text
    # Pass 2: append each position and add its sampled logprob.
    total = cumulative
    for p in range(num_positions):
        total += logprobs[p][0]
        entries = [(token_ids[p][c], logprobs[p][c], ranks[p][0] if c == 0 else c,
                    decoded[p][c]) for c in range(kept)]
        if flat:
            lists[0].append(len(lists[3]))
            for token, value, rank, text in entries:
                lists[2].append(token)
                lists[3].append(value)
                lists[4].append(rank)
                lists[5].append(text)
            lists[1].append(len(lists[3]))
        else:
            container.append({token: logprob_type(value, rank, text)
                              for token, value, rank, text in entries})
    attrs["cumulative_logprob"] = total
    _stats["calls"] += 1
    _stats["positions"] += num_positions
    return num_positions
