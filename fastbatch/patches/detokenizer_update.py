"""Patch: ``vllm.v1.engine.detokenizer.BaseIncrementalDetokenizer.update``.

What is replaced: the method the output processor calls once per request and
step to detokenize the request's new tokens and check its stop strings. The
installed method is one compiled function (``fastbatch.update_detokenizer``)
that grows the output text in place where nothing else holds it; other
detokenizers run vLLM's method. vLLM 0.32.0 to 0.34.0.

Guard: the fingerprints of the method and of
``IncrementalDetokenizer.num_output_tokens``; the activation check on real
detokenizers, their attributes plain; the shadow records what ``decode_next``
answered and replays vLLM's method on a copy.

When it can go: when vLLM builds ``output_text`` without copying it for every
token (a local accumulation, or a list of pieces).

Upstream: vllm-project/vllm#24174 (long-generation detokenizer cost, closed
unmerged); #32975 dropped its join of pieces before merging.

Story and numbers: ``docs/pieces/detokenizer_update.md``.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from fastbatch import registry
from fastbatch.patches._patch import Patch, Shadow, instance_dict_problem

GROUP = "front end"  # fastbatch.registry.GROUPS

MODULE = "vllm.v1.engine.detokenizer"
TARGET = f"{MODULE}:BaseIncrementalDetokenizer.update"
VERIFIED_FINGERPRINTS = {
    "a2c888954407843b79f119f2bed7c8d18103be64353b61cc81bba17106caef55":
        "vLLM 0.32.0-0.33.0",
}
COMPANION_FINGERPRINTS = {
    f"{MODULE}:IncrementalDetokenizer.num_output_tokens": {
        "c1c630e64248bd26da9c7164360fa1b13b2fd555e3f91c036001a4fbd150a91b":
            "vLLM 0.32.0-0.33.0"},
}
# The attributes the compiled call reads (and writes: token_ids in place,
# output_text).
STATE = ("token_ids", "output_text", "stop", "min_tokens", "include_stop_str_in_output")


# The piece in use: the compiled one, or its twin (then the plugin leaves
# vLLM stock anyway).
_piece = registry.implementation("detokenizer_update")

# fastbatch's drop-in for ``BaseIncrementalDetokenizer.update``: the compiled
# function itself, bound on vLLM's class (no Python frame before the compiled
# loop), with vLLM's signature.  ``bind()`` gives it vLLM's method, the type it
# takes and vLLM's module (check_stop_strings, read per call).
update = _piece.update

# The detokenizer type the compiled call takes (set by bind()).
_taken: type | None = None


def _stock_method() -> Any:
    """vLLM's method: the patch's original while applied, else the class's."""
    original = PATCH.original()
    if original is not None:
        return original
    return importlib.import_module(MODULE).BaseIncrementalDetokenizer.update


def bind(stock: Any = None) -> str | None:
    """Bind ``update`` to ``stock`` (by default vLLM's own method) and vLLM's
    ``FastIncrementalDetokenizer``; or why the compiled call cannot take that
    class (then nothing is bound)."""
    global _taken
    module = importlib.import_module(MODULE)
    fast = module.FastIncrementalDetokenizer
    problem = instance_dict_problem(object.__new__(fast), (), STATE)
    if problem is None and fast.__setattr__ is not object.__setattr__:
        problem = "FastIncrementalDetokenizer has its own __setattr__"
    if problem is None and (fast.num_output_tokens
                            is not module.IncrementalDetokenizer.num_output_tokens):
        problem = "FastIncrementalDetokenizer overrides num_output_tokens"
    if problem is not None:
        return problem
    _piece.bind(stock or _stock_method(), fast, vars(module))
    _taken = fast
    return None


# ---------------------------------------------------------------------------
# The activation check: detokenizers whose decode_next answers scripted texts.

TEXTS = {1: "Hello", 2: " world", 3: "", 4: "\u00e9t\u00e9", 5: "\u4e2d", 6: "\U0001f642",
         7: "\n", 8: "STOP", 9: "ST", 10: "OP", 11: "\ufffd", 12: "!",
         13: "a long piece of text, " * 20}  # a few make a text long enough to grow in place


class ScriptedText:
    """A ``decode_next`` (set on the instance) that answers ``TEXTS``, or
    recorded answers in order, and records the token ids it was asked for."""

    def __init__(self, answers: list[tuple[Any, Any]] | None = None) -> None:
        self.answers = answers
        self.asked: list[Any] = []

    def __call__(self, token_id: Any) -> Any:
        self.asked.append(token_id)
        if self.answers is None:
            return TEXTS.get(token_id, "?")
        index = len(self.asked) - 1
        if index >= len(self.answers) or self.answers[index][0] != token_id:
            return ""  # not what fastbatch asked: the calls compared tell
        answer = self.answers[index][1]
        if isinstance(answer, BaseException):
            raise answer
        return answer


def stand_in(state: dict[str, Any], decode_next: Any) -> Any:
    """A ``FastIncrementalDetokenizer`` (built without ``__init__``, which
    needs a tokenizer) with ``state`` (``token_ids`` copied) and
    ``decode_next``."""
    detokenizer = object.__new__(sys.modules[MODULE].FastIncrementalDetokenizer)
    vars(detokenizer).update(state, token_ids=list(state["token_ids"]),
                             decode_next=decode_next)
    return detokenizer


def state_of(detokenizer: Any) -> dict[str, Any]:
    return {name: vars(detokenizer)[name] for name in STATE}


def _scripts() -> list[tuple[dict[str, Any], list[tuple[list[int], bool]]]]:
    """(initial state, the updates (new_token_ids, stop_terminated))."""
    def state(stop: list[str], min_tokens: int = 0, include: bool = False) -> dict[str, Any]:
        return {"token_ids": [], "output_text": "", "stop": stop, "min_tokens": min_tokens,
                "include_stop_str_in_output": include}

    plain = [([1], False), ([2], False), ([], False), ([3], False), ([1, 2], False),
             ([4], False), ([12], False), ([5], False), ([1], False), ([6], False),
             ([11, 12], False), ([7], True), ([2], True)]
    stopping = [([1], False), ([9], False), ([10, 2, 1], False), ([12], False)]
    return [
        (state([]), plain),
        (state(["\n"], include=True), plain),
        (state(["zz"]), [([1], False), ([2], False), ([12], True)]),
        (state(["STOP"]), stopping),
        (state(["STOP"], include=True), stopping),
        (state(["world", "STOP"], min_tokens=3), [([1, 2], False), ([8], False),
                                                  ([1, 2], False)]),
        (state(["\u00e9", "lo"]), [([6, 1], False), ([4, 2, 8], False)]),
        (state(["!"]), [([1], False), ([12], True)]),
        (state(["!"], include=True), [([1], False), ([12], True)]),
        (state(["\U0001f642"]), [([5, 5], False), ([6, 1], False)]),
        # texts past the in-place threshold: ASCII, then Latin-1, UCS-2, UCS-4
        (state([]), [([13], False)] * 6 + [([4], False), ([13], False), ([13], False),
                                          ([5], False), ([13, 1], False), ([6], False),
                                          ([13], False), ([13], True)]),
        (state(["!"]), [([13, 13], False), ([1], False), ([13, 12, 13], False)]),
    ]


def _code_points(text: str) -> list[int]:
    return [ord(char) for char in text]


def activation_check(method: Any, replacement: Any) -> str | None:
    """Why fastbatch must stay off: the class cannot be taken (``bind``), or
    ``method`` and ``replacement`` differ on the scripted detokenizers."""
    problem = bind(method)
    if problem is not None:
        return problem
    for initial, updates in _scripts():
        stock = stand_in(initial, ScriptedText())
        ours = stand_in(initial, ScriptedText())
        # Every other text is kept, as a caller's RequestOutput would keep
        # it: it must never change; the others may grow in place.
        held = []
        for step, (new_token_ids, stop_terminated) in enumerate(updates):
            expected = method(stock, list(new_token_ids), stop_terminated)
            got = replacement(ours, list(new_token_ids), stop_terminated)
            if step % 2:
                held.append((ours.output_text, _code_points(ours.output_text)))
            if (got, state_of(ours), ours.decode_next.asked) != (
                    expected, state_of(stock), stock.decode_next.asked):
                return (f"{initial} after {new_token_ids}: fastbatch gave {got!r}, "
                        f"{state_of(ours)}, vLLM gave {expected!r}, {state_of(stock)}")
        changed = [kept for kept, copy in held if _code_points(kept) != copy]
        if changed:
            return f"a text held by a caller was changed: {changed[0]}"
    return None


# ---------------------------------------------------------------------------
# The shadow check.

_ABSENT = object()  # no decode_next of the instance's own


class Recording:
    """The live detokenizer's ``decode_next`` while fastbatch's call runs
    (set on the instance): vLLM's, with each answer recorded."""

    def __init__(self, decode_next: Any, answers: list[tuple[Any, Any]]) -> None:
        self.decode_next = decode_next
        self.answers = answers

    def __call__(self, token_id: Any) -> Any:
        try:
            text = self.decode_next(token_id)
        except Exception as exc:
            self.answers.append((token_id, exc))
            raise
        self.answers.append((token_id, text))
        return text


class TokenTail:
    """The ``token_ids`` of the shadow's stand-in: how many ids came before
    the call, and the ids from there on.  vLLM's method reads the length,
    appends, and deletes from the first new id on: what it does is in the
    tail, and the shadow costs the same at any output length."""

    def __init__(self, before: int, tail: list[Any]) -> None:
        self.before = before
        self.tail = tail

    def __len__(self) -> int:
        return self.before + len(self.tail)

    def append(self, token_id: Any) -> None:
        self.tail.append(token_id)

    def __delitem__(self, key: slice) -> None:
        if (type(key) is not slice or key.stop is not None or key.step is not None
                or key.start < self.before):
            raise IndexError(f"only ids from {self.before} on are kept, not {key}")
        del self.tail[key.start - self.before:]


def _snapshot(detokenizer: Any, new_token_ids: Any, stop_terminated: Any) -> Any:
    if type(detokenizer) is not _taken or type(new_token_ids) is not list:
        return None  # vLLM's own method runs: nothing to check
    attrs = vars(detokenizer)
    state = {name: attrs[name] for name in STATE if name != "token_ids"}
    inputs = {"state": state, "before": len(attrs["token_ids"]),
              "new_token_ids": list(new_token_ids),
              "stop_terminated": stop_terminated, "answers": [],
              "own_decode_next": attrs.get("decode_next", _ABSENT)}
    attrs["decode_next"] = Recording(detokenizer.decode_next, inputs["answers"])
    return inputs


def _check(inputs: dict[str, Any], result: Any, detokenizer: Any, *args: Any) -> bool:
    """Right after fastbatch's call: the recording taken off again."""
    attrs = vars(detokenizer)
    if inputs.pop("own_decode_next") is _ABSENT:
        del attrs["decode_next"]
    else:
        attrs["decode_next"] = inputs["own_decode_next"]
    return True


def _run(method: Any, inputs: dict[str, Any]) -> tuple[Any, ...]:
    """``method`` on a stand-in whose ``decode_next`` answers what vLLM's
    answered fastbatch's call, and whose ``token_ids`` is a ``TokenTail``:
    its outcome."""
    detokenizer = object.__new__(sys.modules[MODULE].FastIncrementalDetokenizer)
    tail = TokenTail(inputs["before"], [])
    vars(detokenizer).update(inputs["state"], token_ids=tail,
                             decode_next=ScriptedText(inputs["answers"]))
    result = method(detokenizer, list(inputs["new_token_ids"]), inputs["stop_terminated"])
    return (result, detokenizer.decode_next.asked, tail.tail, detokenizer.output_text)


def _outcome(inputs: dict[str, Any], result: Any, detokenizer: Any,
             *args: Any) -> tuple[Any, ...]:
    attrs = vars(detokenizer)
    return (result, [token_id for token_id, _ in inputs["answers"]],
            attrs["token_ids"][inputs["before"]:], attrs["output_text"])


def _restore(inputs: dict[str, Any], stock: tuple[Any, ...], result: Any, detokenizer: Any,
             *args: Any) -> Any:
    """vLLM's token ids (in the same list) and text in place."""
    attrs = vars(detokenizer)
    attrs["token_ids"][inputs["before"]:] = stock[2]
    attrs["output_text"] = stock[3]
    return stock[0]


SHADOW = Shadow(snapshot=_snapshot, run=_run, outcome=_outcome, restore=_restore,
                check=_check)

PATCH = Patch(TARGET, update, fingerprints=VERIFIED_FINGERPRINTS,
              companions=COMPANION_FINGERPRINTS, activation_check=activation_check,
              shadow=SHADOW)
