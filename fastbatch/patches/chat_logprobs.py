"""Patch: ``OpenAIServingChat._create_chat_logprobs``
(``vllm.entrypoints.openai.chat_completion.serving``).

What is replaced: the chat completions API's builder of a choice's
``logprobs`` object (``/v1/chat/completions`` with ``logprobs``: the whole
completion at once, or each streamed delta). One compiled call
(``fastbatch.create_chat_logprobs``) builds the same objects without a
pydantic validation per token. vLLM 0.30.0 to 0.34.0.

Guard: the fingerprints of the method and of what the compiled call stands in
for (the companions); the activation check on a stand-in of the serving class
with a small byte-level tokenizer; the shadow compares the objects.

When it can go: if vLLM builds these responses without a pydantic validation
per token (``model_construct``, or plain dicts serialised once).

Upstream: none for the chat API; vllm-project/vllm#57442 (open) takes
sampled-token logprobs past this path for ``/inference/v1/generate`` only.

Story and numbers: ``docs/pieces/chat_logprobs.md``.
"""

from __future__ import annotations

import importlib
import math
import sys
from typing import Any

import fastbatch
from fastbatch.patches._patch import Patch, Shadow
from fastbatch.patches._texts import ByteTokenizer

GROUP = "front end"  # fastbatch.registry.GROUPS

MODULE = "vllm.entrypoints.openai.chat_completion.serving"
BASE_MODULE = "vllm.entrypoints.generate.base.serving"
TARGET = f"{MODULE}:OpenAIServingChat._create_chat_logprobs"
VERIFIED_FINGERPRINTS = {
    "a6c296db1e0685992ecbf12e22e030ac9acb62b1e6ec7a9e7d73eca095e65520": "vLLM 0.30.0-0.33.0",
}
# _get_top_logprobs: which rule keeps how many entries of a position.
_TOP_032 = "9239150b605679b060b38c77908d60fa428494db80ea75381f32ee27a8e8d5e1"
_TOP_033 = "ce227a5564c26d99e4603d02b535adcb08d8ce35f93351273ae4c510dd73bdf5"
COMPANION_FINGERPRINTS = {
    f"{MODULE}:OpenAIServingChat._get_top_logprobs": {
        _TOP_032: "vLLM 0.30.0-0.32.0: the first top_logprobs (all for -1 or logprob_token_ids)",
        _TOP_033: "vLLM 0.33.0: islice by chat_top_logprobs_limit"},
    f"{BASE_MODULE}:GenerateBaseServing._get_decoded_token": {
        "e9da13229a36f0e13a828d6c4432f4c8661e8984b289cd7560e076ba170440c0": "vLLM 0.30.0-0.33.0"},
    f"{BASE_MODULE}:format_token_id_placeholder": {
        "1c17c83319ab7237f3d9840e8285d15e15c9ca32b2e0fed7605505e303f90d75": "vLLM 0.30.0-0.33.0"},
    "vllm.entrypoints.serve.engine.protocol:OpenAIBaseModel.__log_extra_fields__": {
        "be6dd8b32daf5e99930a73cb547915e7f7e3ffd67a7c4f903f024777402827e9": "vLLM 0.30.0-0.33.0"},
}
PROTOCOL = "vllm.entrypoints.openai.chat_completion.protocol"

# Bound on first use (this module imports no vLLM until then).
_KINDS: tuple[type, type, type] | None = None
_PLAIN: dict[type, bool] = {}  # serving class -> uses vLLM's own helpers
_LIMIT_OF: Any = None  # vLLM 0.33's chat_top_logprobs_limit, or None (0.32's rule)


def _bind() -> None:
    global _KINDS, _LIMIT_OF
    from fastbatch._fingerprint import fingerprint

    protocol = importlib.import_module(PROTOCOL)
    serving = sys.modules[MODULE]
    _KINDS = (protocol.ChatCompletionLogProb, protocol.ChatCompletionLogProbsContent,
              protocol.ChatCompletionLogProbs)
    top = fingerprint(serving.OpenAIServingChat._get_top_logprobs)
    _LIMIT_OF = serving.chat_top_logprobs_limit if top == _TOP_033 else None


def _is_plain(cls: type) -> bool:
    """``cls`` uses vLLM's own ``_get_top_logprobs`` and ``_get_decoded_token``."""
    plain = _PLAIN.get(cls)
    if plain is None:
        base = sys.modules[MODULE].OpenAIServingChat
        plain = _PLAIN[cls] = (
            cls._get_top_logprobs is base._get_top_logprobs
            and cls._get_decoded_token is base._get_decoded_token)
    return plain


_REFUSED = object()


def _limit(top_logprobs: Any, return_all: bool) -> Any:
    """How many entries of each position vLLM keeps (None: all), or _REFUSED
    where its rule is not one the compiled call takes."""
    if _LIMIT_OF is not None:  # vLLM 0.33: islice(items, chat_top_logprobs_limit(...))
        if top_logprobs is not None and type(top_logprobs) is not int:
            return _REFUSED
        limit = _LIMIT_OF(top_logprobs, return_all)
        return limit if limit is None or (type(limit) is int and limit >= 0) else _REFUSED
    # vLLM 0.32: entry i is kept if return_all or top_logprobs == -1 or i < top_logprobs.
    if return_all or top_logprobs == -1:
        return None
    if top_logprobs is None:
        return 0
    return max(top_logprobs, 0) if type(top_logprobs) is int else _REFUSED


def _stock_method() -> Any:
    """vLLM's method: the patch's original while applied, else the class's."""
    original = PATCH.original()
    if original is not None:
        return original
    return sys.modules[MODULE].OpenAIServingChat._create_chat_logprobs


def _create_chat_logprobs(self: Any, token_ids: Any, top_logprobs: Any, tokenizer: Any,
                          num_output_top_logprobs: int | None = None,
                          logprob_token_ids: list[int] | None = None,
                          return_as_token_id: bool | None = None) -> Any:
    """fastbatch's drop-in for ``OpenAIServingChat._create_chat_logprobs``."""
    if _KINDS is None:
        _bind()
    as_token_id = (return_as_token_id if return_as_token_id is not None
                   else self.return_tokens_as_token_ids)
    if type(as_token_id) is bool and _is_plain(type(self)):
        limit = _limit(num_output_top_logprobs, bool(logprob_token_ids))
        if limit is not _REFUSED:
            try:
                return fastbatch.create_chat_logprobs(token_ids, top_logprobs, tokenizer,
                                                      limit, as_token_id, _KINDS)
            except (TypeError, ValueError):  # nothing outside the results was written
                pass
    return _stock_method()(self, token_ids, top_logprobs, tokenizer,
                           num_output_top_logprobs, logprob_token_ids, return_as_token_id)


# ---------------------------------------------------------------------------
# The activation check.

def model_outcome(value: Any) -> Any:
    """``value`` (a pydantic model, or a list, dict or scalar in one) in a
    comparable, picklable form: each model's type, fields in order, fields
    set, extra and private state; floats as their hex (bit for bit)."""
    if hasattr(type(value), "__pydantic_fields__"):
        state = (sorted(value.__pydantic_fields_set__), value.__pydantic_extra__,
                 value.__pydantic_private__)
        return (type(value).__name__, [(name, model_outcome(item))
                                       for name, item in value.__dict__.items()],
                model_outcome(state), _json(value))
    if type(value) in (list, tuple):
        return (type(value).__name__, [model_outcome(item) for item in value])
    if type(value) is dict:
        return ("dict", [(model_outcome(k), model_outcome(v)) for k, v in value.items()])
    if type(value) is float:
        return ("float", value.hex())
    return (type(value).__name__, value)


class _ChatTokenizer(ByteTokenizer):
    """vLLM decodes a position with no entry as ``tokenizer.decode(token_id)``."""

    def decode(self, ids: Any, **kwargs: Any) -> str:
        return super().decode([ids] if type(ids) is int else ids, **kwargs)


def _json(model: Any) -> str:
    """What pydantic writes of ``model`` (or the error it raises)."""
    try:
        return model.model_dump_json()
    except Exception as exc:  # a lone surrogate: pydantic refuses both alike
        return f"{type(exc).__name__}: {exc}"


def _stand_in(as_token_ids: bool) -> Any:
    """An ``OpenAIServingChat`` with what the method reads (built without
    ``__init__``, which needs an engine)."""
    serving = object.__new__(sys.modules[MODULE].OpenAIServingChat)
    serving.return_tokens_as_token_ids = as_token_ids
    return serving


def _synthetic_calls() -> list[tuple[bool, dict[str, Any]]]:
    """(the serving's return_tokens_as_token_ids, the call's arguments)."""
    logprobs = importlib.import_module("vllm.logprobs")
    Logprob, FlatLogprobs = logprobs.Logprob, logprobs.FlatLogprobs
    positions = [
        {65: Logprob(-0.25, 1, "A"), 66: Logprob(-1.5, 2, "B"), 67: Logprob(-2.0, 3, "C")},
        {0xC3: Logprob(-0.5, 2, ""), 257: Logprob(-0.125, 1, "\u00e9t\u00e9"),
         0xC3 + 1: Logprob(-math.inf, 3, "\ufffd")},
        None,  # no logprobs at this position: the text alone
        {300: Logprob(float("nan"), 1, None), 256: Logprob(-20000.0, 2, " the")},
        {70: Logprob(-3.0, 1, "F")},  # the sampled token (71) has no entry
        {72: Logprob(-0.0, 1, "\ud800x"), 73: Logprob(-1e-30, 2, None)},
    ]
    token_ids = [65, 257, 0xE2, 300, 71, 72]
    flat = FlatLogprobs()
    for position in positions:
        flat.append(position)
    calls = []
    for top in (None, 0, 1, 2, -1):
        for as_ids in (False, True):
            calls.append((as_ids, {"token_ids": token_ids, "top_logprobs": positions,
                                   "num_output_top_logprobs": top,
                                   "return_as_token_id": None}))
        calls.append((False, {"token_ids": tuple(token_ids), "top_logprobs": flat,
                              "num_output_top_logprobs": top, "return_as_token_id": True}))
    calls.append((True, {"token_ids": token_ids, "top_logprobs": positions,
                         "num_output_top_logprobs": 1, "logprob_token_ids": [65, 66],
                         "return_as_token_id": False}))
    calls.append((False, {"token_ids": [], "top_logprobs": [],
                          "num_output_top_logprobs": 2}))
    return calls


def activation_check(method: Any, replacement: Any) -> str | None:
    """Run both on the synthetic calls; why the results differ, or None."""
    for as_ids, call in _synthetic_calls():
        arguments = {"tokenizer": _ChatTokenizer(), **call}
        expected = model_outcome(method(_stand_in(as_ids), **arguments))
        got = model_outcome(replacement(_stand_in(as_ids), **arguments))
        if got != expected:
            return f"{call}: fastbatch gave {got}, vLLM gave {expected}"
    return None


# ---------------------------------------------------------------------------
# The shadow check.

_PARAMETERS = ("token_ids", "top_logprobs", "tokenizer", "num_output_top_logprobs",
               "logprob_token_ids", "return_as_token_id")


def _snapshot(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    call = dict(zip(_PARAMETERS, args, strict=False)) | kwargs
    return {"self": self, "call": call}


def _run(method: Any, inputs: dict[str, Any]) -> Any:
    return model_outcome(method(inputs["self"], **inputs["call"]))


def _outcome(inputs: dict[str, Any], result: Any, *args: Any, **kwargs: Any) -> Any:
    return model_outcome(result)


def _restore(inputs: dict[str, Any], stock: Any, result: Any, *args: Any,
             **kwargs: Any) -> Any:
    """vLLM's result (its method reads only its arguments: run it again)."""
    return _stock_method()(inputs["self"], **inputs["call"])


def _for_reproducer(inputs: dict[str, Any]) -> dict[str, Any]:
    """The serving object as a stand-in with its one setting read."""
    return {"self": _stand_in(inputs["self"].return_tokens_as_token_ids),
            "call": inputs["call"]}


SHADOW = Shadow(snapshot=_snapshot, run=_run, outcome=_outcome, restore=_restore,
                for_reproducer=_for_reproducer)

PATCH = Patch(TARGET, _create_chat_logprobs, fingerprints=VERIFIED_FINGERPRINTS,
              companions=COMPANION_FINGERPRINTS, activation_check=activation_check,
              shadow=SHADOW)
