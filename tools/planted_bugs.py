"""Subtle bugs planted in fastbatch's pieces, for the FASTBATCH_VERIFY
end-to-end test (tools/vllm_generate.py ``--plant-bugs``; tests only).

Each bug wraps the piece's compiled function (``fastbatch.<function>``, which
the patch calls at run time; ``allocate_slots``, ``detokenizer_update`` and
``update_sample_logprobs``, whose compiled functions are themselves the
installed methods, through their patches' ``replacement``, which the shadow
check calls; ``process_outputs`` through its patch's module, whose function
the checked turn calls) so that it
goes wrong only where the piece's activation check never looks: batches of
more than ``BIG_BATCH`` requests (``SMALL_SPEC_BATCH`` for the spec pieces),
token ids of at least ``BIG_ID``, requests past ``LATE_TOKENS`` tokens (or
logprobs positions).  The
activation checks pass; only the shadow checks can see the bugs.  Planted
after the engine is built (the plugin has applied the pieces), before the
traffic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

BIG_BATCH = 12
SMALL_SPEC_BATCH = 6  # the spec pieces' checks use at most 6 rows
BIG_ID = 256
LATE_TOKENS = 20


def _wrap(function: str, after: Callable[..., Any]) -> None:
    """``fastbatch.<function>`` calls the real one, then ``after(result,
    *args)``, whose return value (or the result, if None) it returns."""
    import fastbatch

    real = getattr(fastbatch, function)

    def planted(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        changed = after(result, *args, **kwargs)
        return result if changed is None else changed

    setattr(fastbatch, function, planted)


def _last_big_id_flipped(result, req_ids, prev, output_token_ids, *rest, **kwargs):
    for ids in output_token_ids:
        if ids and ids[-1] >= BIG_ID:
            ids[-1] ^= 1


def _first_draft_flipped(result, req_ids, prev, spec_token_ids, draft_token_ids):
    if len(req_ids) > BIG_BATCH:
        for ids in spec_token_ids:
            if ids:
                ids[0] ^= 1
                return


def _first_penalty_id_moved(tensor, output_token_ids, vocab_size, *rest):
    if len(output_token_ids) > BIG_BATCH and tensor.numel():
        tensor[0, 0] = (int(tensor[0, 0]) + 1) % vocab_size


def _bookkeeping_count_off(result, req_ids, requests, num_sampled_tokens, valid, discarded,
                           num_tokens_no_spec, *rest):
    if num_sampled_tokens > BIG_BATCH:
        num_tokens_no_spec[0] += 1


def _first_prev_position_off(result, req_ids, prev, prev_positions, num_reqs):
    if num_reqs > BIG_BATCH:
        prev_positions[0] += 1


def _input_rows_reversed(result, req_ids, prev_positions, cu_num_tokens, spec, prev_spec,
                         num_reqs):
    import numpy as np

    common, spec_indices, _, max_index = result
    if num_reqs > BIG_BATCH:
        return np.stack([common[0], common[1][::-1]]), spec_indices, False, max_index
    return None


def _after_schedule_counter_off(done, scheduler, output, *rest, **kwargs):
    if done and len(output.num_scheduled_tokens) > BIG_BATCH:
        scheduler.requests[next(iter(output.num_scheduled_tokens))].num_computed_tokens += 1


def _cached_count_off(lists, running, resumed, *rest, **kwargs):
    if len(running) + len(resumed) > BIG_BATCH:
        lists[4][-1] += 1


def _first_sampled_id_flipped(rows, *args, **kwargs):
    if len(rows) > BIG_BATCH:
        for row in rows:
            if row:
                row[0] ^= 1
                return


def _last_accepted_id_dropped(result, *args, **kwargs):
    if len(result) > SMALL_SPEC_BATCH:
        for row in result:
            if row:
                row.pop()
                return


def _first_draft_id_flipped(rows, buffer, num_reqs, num_spec_tokens):
    if num_reqs > SMALL_SPEC_BATCH and rows and rows[0]:
        rows[0][0] ^= 1


def _first_taken_token_off(result, scheduler, *rest, **kwargs):
    """The last token of the first request taken (a slot that is not a
    request id) made wrong in both of its token lists."""
    slots = () if result is None else result[0]
    taken = [slot for slot in slots if not isinstance(slot, str)]
    if len(taken) > BIG_BATCH:
        request = scheduler.requests[taken[0].request_id]
        request._output_token_ids[-1] += 1
        request._all_token_ids[-1] = request._output_token_ids[-1]


def _budget_token_short(result, scheduler, req_index, token_budget, input_budget, draft_slots,
                        threshold, defer_prefills, prefill_scheduled, drafts_needed,
                        scheduled_running_reqs, *rest):
    """The token budget one short after a loop that scheduled more than
    ``BIG_BATCH`` requests (the activation check's batches have ten)."""
    if len(scheduled_running_reqs) > BIG_BATCH:
        index, budget, inputs, prefill, drafts = result
        return index, budget - 1, inputs, prefill, drafts
    return None


def _late_cumulative_logprob_off() -> None:
    """A request's cumulative logprob one off once it has more than
    ``LATE_TOKENS`` positions (the activation check's have at most nine)."""
    from fastbatch.patches.update_sample_logprobs import PATCH

    real = PATCH.replacement

    def planted(self, logprobs_lists):
        result = real(self, logprobs_lists)
        if len(self.logprobs) > LATE_TOKENS:
            self.cumulative_logprob += 1.0
        return result

    PATCH.replacement = planted


def _late_weight_version_span() -> None:
    """A weight-version span too many once a request has more than
    ``LATE_TOKENS`` tokens (the activation check's have at most five): it
    shows only in the spans of the request's final output, not in its tokens."""
    from fastbatch.patches import process_outputs

    real = process_outputs._piece.process_output

    def planted(processor, output, *args):
        state = processor.request_states.get(output.request_id)
        taken = real(processor, output, *args)
        if taken and state is not None and len(state.detokenizer.token_ids) > LATE_TOKENS:
            state.weight_version_starts.append(("planted", 0))
        return taken

    process_outputs._piece.process_output = planted


def _late_text_off() -> None:
    """A character too many in a request's text once it has more than
    ``LATE_TOKENS`` tokens (the activation check's have at most 15)."""
    from fastbatch.patches.detokenizer_update import PATCH

    real = PATCH.replacement

    def planted(self, new_token_ids, stop_terminated):
        result = real(self, new_token_ids, stop_terminated)
        if len(self.token_ids) > LATE_TOKENS:
            self.output_text += "!"
        return result

    PATCH.replacement = planted


def _allocate_slots_refuses_late_decodes() -> None:
    from fastbatch.patches.allocate_slots import PATCH

    real = PATCH.replacement

    def planted(self, request, num_new_tokens, *args, **kwargs):
        if (request.num_computed_tokens > LATE_TOKENS and num_new_tokens == 1
                and not kwargs.get("num_lookahead_tokens")):
            return None  # "no room": vLLM would have allocated or said nothing to do
        return real(self, request, num_new_tokens, *args, **kwargs)

    PATCH.replacement = planted


BUGS: dict[str, Callable[[], None]] = {
    "async_output_token_ids": lambda: _wrap("update_async_output_token_ids",
                                            _last_big_id_flipped),
    "async_spec_token_ids": lambda: _wrap("update_async_spec_token_ids", _first_draft_flipped),
    "penalty_output_tokens": lambda: _wrap("output_tokens_tensor", _first_penalty_id_moved),
    "bookkeeping_sync": lambda: _wrap("append_sampled_token_ids", _bookkeeping_count_off),
    "prev_positions": lambda: _wrap("compute_prev_positions", _first_prev_position_off),
    "prepare_input_ids": lambda: _wrap("prepare_input_ids_indices", _input_rows_reversed),
    "after_schedule": lambda: _wrap("update_after_schedule", _after_schedule_counter_off),
    "cached_requests": lambda: _wrap("cached_request_lists", _cached_count_off),
    "allocate_slots": _allocate_slots_refuses_late_decodes,
    "get_output": lambda: _wrap("sampled_token_lists", _first_sampled_id_flipped),
    "parse_output": lambda: _wrap("rejection_output_lists", _last_accepted_id_dropped),
    "draft_token_ids": lambda: _wrap("draft_token_lists", _first_draft_id_flipped),
    "update_from_output": lambda: _wrap("take_decode_outputs", _first_taken_token_off),
    "schedule_running": lambda: _wrap("schedule_running_requests", _budget_token_short),
    "update_sample_logprobs": _late_cumulative_logprob_off,
    "detokenizer_update": _late_text_off,
    "process_outputs": _late_weight_version_span,
}


def plant(names: list[str]) -> None:
    """Plant the bugs of the pieces ``names`` (``["all"]``: every one)."""
    for name in BUGS if names == ["all"] else names:
        BUGS[name]()
