"""Pure-Python twin of the compiled piece ``chat_logprobs``: the test oracle.

Same signature, rules, errors and counters as
``fastbatch._kernels.chat_logprobs``; written for reading, not for speed.
"""

from __future__ import annotations

__all__ = ["create_chat_logprobs"]

import itertools
from typing import Any

from fastbatch._reference._common import Counters

_counters = Counters(("calls", "positions", "decoded"))
stats, reset_stats = _counters.stats, _counters.reset_stats
_stats = _counters.values

FLOOR = -9999.0  # vLLM's max(logprob, -9999.0), and the field's default
GIVEN_MISSING = frozenset(("token", "bytes"))
GIVEN_CONTENT = frozenset(("token", "logprob", "bytes", "top_logprobs"))
GIVEN_TOP = frozenset(("token", "logprob", "bytes"))
GIVEN_LOGPROBS = frozenset(("content",))


def _model(cls: type, values: dict[str, Any], given: frozenset[str]) -> Any:
    """An instance of the pydantic model ``cls`` as validation leaves it."""
    instance = object.__new__(cls)
    object.__setattr__(instance, "__dict__", values)
    object.__setattr__(instance, "__pydantic_fields_set__", set(given))
    object.__setattr__(instance, "__pydantic_extra__", {})
    object.__setattr__(instance, "__pydantic_private__", None)
    return instance


def _exact_text(text: Any, what: str) -> str:
    if type(text) is not str:
        raise TypeError(f"{what} must be a str, got {type(text).__name__}")
    return text


def _decode(tokenizer: Any, ids: Any) -> str:
    if tokenizer is None:
        raise ValueError("no tokenizer to decode with")
    _stats["decoded"] += 1
    return _exact_text(tokenizer.decode(ids), "the tokenizer's decode")


def _logprob_value(logprob: Any) -> float:
    value = logprob.logprob
    if type(value) is not float:
        raise TypeError(f"Logprob.logprob must be a float, got {type(value).__name__}")
    return max(value, FLOOR)


def _decoded_token(logprob: Any, token_id: int, tokenizer: Any, as_token_id: bool) -> str:
    if as_token_id:
        return f"token_id:{token_id}"
    text = logprob.decoded_token
    if text is not None:
        return _exact_text(text, "Logprob.decoded_token")
    return _decode(tokenizer, [token_id])


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def create_chat_logprobs(token_ids: Any, top_logprobs: Any, tokenizer: Any, limit: Any,
                         as_token_id: bool, kinds: tuple[type, type, type]) -> Any:
    """The ``ChatCompletionLogProbs`` of ``token_ids``.

    vLLM's ``OpenAIServingChat._create_chat_logprobs(token_ids, top_logprobs,
    tokenizer, ...)`` (vLLM 0.30.0 on), with the number of ``top_logprobs``
    entries per position already worked out as ``limit`` (None: all, else an
    int >= 0: the first ``limit`` of the position's dict) and
    ``return_as_token_id`` as ``as_token_id``.  ``kinds`` is
    ``(ChatCompletionLogProb, ChatCompletionLogProbsContent,
    ChatCompletionLogProbs)``.

    ``token_ids`` must be a list or tuple of ints, each item of
    ``top_logprobs`` (``top_logprobs[i]``) None or a dict of ``Logprob``;
    texts must be exact strs and logprobs exact floats.  Anything else is a
    TypeError (a position with no entry and no tokenizer: a ValueError);
    nothing outside the returned objects is written.
    """
    if kinds is None:
        raise TypeError("kinds must be a tuple, got NoneType")
    if len(kinds) != 3:
        raise ValueError(f"kinds must be (ChatCompletionLogProb, "
                         f"ChatCompletionLogProbsContent, ChatCompletionLogProbs), got "
                         f"{len(kinds)} items")
    top_type, content_type, logprobs_type = kinds
    if type(token_ids) not in (list, tuple):
        raise TypeError(f"token_ids must be a list or tuple, got {type(token_ids).__name__}")
    ids = tuple(token_ids)
    if limit is not None and (type(limit) is not int or limit < 0):
        raise TypeError(f"limit must be None or an int >= 0, got {limit!r}")
    as_token_id = bool(as_token_id)
    content = []
    for i, token_id in enumerate(ids):
        if type(token_id) is not int:
            raise TypeError(f"token_ids[{i}] must be an int, got {type(token_id).__name__}")
        if type(top_logprobs) is list and i >= len(top_logprobs):
            raise TypeError(f"top_logprobs has {len(top_logprobs)} positions, "
                            f"token_ids {len(ids)}")
        step = top_logprobs[i]
        entry = None
        if step is not None:
            if type(step) is not dict:
                raise TypeError(f"top_logprobs[{i}] must be a dict or None, got "
                                f"{type(step).__name__}")
            entry = step.get(token_id)
        if entry is None:
            token = f"token_id:{token_id}" if as_token_id else _decode(tokenizer, token_id)
            content.append(_model(content_type, {"token": token, "logprob": FLOOR,
                                                 "bytes": _utf8(token), "top_logprobs": []},
                                  GIVEN_MISSING))
            continue
        step_decoded = entry.decoded_token
        if step_decoded is not None:
            _exact_text(step_decoded, "Logprob.decoded_token")
        token = _decoded_token(entry, token_id, tokenizer, as_token_id)
        value = _logprob_value(entry)
        tops = []
        for top_id, top in itertools.islice(step.items(), limit):
            top_token = _decoded_token(top, top_id, tokenizer, as_token_id)
            tops.append(_model(top_type, {"token": top_token, "logprob": _logprob_value(top),
                                          "bytes": _utf8(top_token)}, GIVEN_TOP))
        content.append(_model(content_type, {
            "token": token, "logprob": value,
            "bytes": None if step_decoded is None else _utf8(step_decoded),
            "top_logprobs": tops}, GIVEN_CONTENT))
    _stats["calls"] += 1
    _stats["positions"] += len(ids)
    return _model(logprobs_type, {"content": content}, GIVEN_LOGPROBS)
