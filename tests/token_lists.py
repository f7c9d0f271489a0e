"""Inputs and oracles for the spec-token update and the penalties' tensor.

``spec_batches`` draws what vLLM's ``InputBatch.update_async_spec_token_ids``
reads, with the aliasing its loop can meet (two requests mapped to one draft
row, one list shared by two requests, a spec list that is also a draft row);
``vllm_0_33_spec_loop`` is that method's loop, and ``real_spec_batch`` builds
one as a real vLLM ``InputBatch`` (importing vLLM when called, for the
``vllm``-marked tests).  ``penalty_rows`` draws the
output lists the penalties turn into a tensor; ``vllm_0_33_penalty_array``
is stock's computation of it.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
from hypothesis import strategies as st

from batches import Batch, Token, real_input_batch

# Draft rows hold whatever vLLM put there (ints from tolist()); the loop only
# moves them, so odd objects are copied as they are.
DRAFT_ITEMS = st.one_of(st.integers(0, 200_000),
                        st.sampled_from([-1, Token(7), 2**70, True]))


@dataclasses.dataclass
class SpecBatch:
    req_ids: list[str | None]
    prev_req_id_to_index: dict[str, int]
    spec_token_ids: list[list[int] | None]
    draft_token_ids: list[list[int] | None]

    def clone(self) -> SpecBatch:
        """A deep copy that keeps which lists are shared with which."""
        return copy.deepcopy(self)

    def lists(self) -> tuple[list, list]:
        return self.spec_token_ids, self.draft_token_ids


@st.composite
def spec_batches(draw, max_reqs: int = 10, max_k: int = 6) -> SpecBatch:
    """A valid input covering every case vLLM's loop handles."""
    num_reqs = draw(st.integers(0, max_reqs))
    req_ids = [None if draw(st.integers(0, 7)) == 0 else f"req-{i}"
               for i in range(num_reqs)]
    num_rows = draw(st.integers(0, max_reqs))
    draft_token_ids = [None if draw(st.integers(0, 15)) == 0
                       else draw(st.lists(DRAFT_ITEMS, max_size=max_k))
                       for _ in range(num_rows)]
    # zip() stops at the shorter: spec lists may be fewer or more than ids.
    num_spec = max(0, num_reqs + draw(st.integers(-2, 2)))
    spec_token_ids = [None if draw(st.integers(0, 15)) == 0
                      else [-1] * draw(st.integers(0, max_k))
                      for _ in range(num_spec)]
    for _ in range(draw(st.integers(0, 2))):  # aliasing, rare in vLLM
        if not spec_token_ids:
            break
        target = draw(st.integers(0, num_spec - 1))
        if num_rows and draw(st.booleans()):
            spec_token_ids[target] = draft_token_ids[draw(st.integers(0, num_rows - 1))]
        else:
            spec_token_ids[target] = spec_token_ids[draw(st.integers(0, num_spec - 1))]

    prev_req_id_to_index: dict[str, int] = {}
    if num_rows:
        as_index = st.sampled_from([int, int, int, np.int64, Token])
        for req_id in req_ids:
            if req_id is not None and draw(st.integers(0, 4)):  # else: new request
                prev_req_id_to_index[req_id] = draw(as_index)(
                    draw(st.integers(0, num_rows - 1)))
    for k in range(draw(st.integers(0, 2))):  # finished requests still mapped
        prev_req_id_to_index[f"finished-{k}"] = draw(st.integers(0, 50))
    return SpecBatch(req_ids, prev_req_id_to_index, spec_token_ids, draft_token_ids)


def vllm_0_33_spec_loop(req_ids, prev_req_id_to_index, spec_token_ids,
                        draft_token_ids) -> int:
    """The loop of vLLM 0.33.0's ``InputBatch.update_async_spec_token_ids``.

    Transcribed line for line (Apache-2.0, vllm/v1/worker/gpu_input_batch.py;
    the same in 0.21.0 to 0.33.0), with the batch's attributes as arguments,
    counting the requests it updates.
    """
    updated = 0
    for req_id, spec_ids in zip(req_ids, spec_token_ids, strict=False):
        if spec_ids:
            prev_index = prev_req_id_to_index.get(req_id)
            if prev_index is not None:
                draft_ids = draft_token_ids[prev_index]
                if draft_ids:
                    del draft_ids[len(spec_ids):]
                    spec_ids.clear()
                    spec_ids.extend(draft_ids)
                    updated += 1
    return updated


def real_spec_batch(batch: SpecBatch):
    """A real InputBatch with ``batch``'s requests; each spec list filled by
    vLLM's own ``update_req_spec_token_ids`` with as many placeholders as
    ``batch`` has (a real batch has no shared or ``None`` spec lists)."""
    num_reqs = len(batch.req_ids)
    outputs = Batch(batch.req_ids, {}, [None if r is None else [1] for r in batch.req_ids],
                    sampled=np.zeros((0, 0), dtype=np.int64))
    input_batch, states = real_input_batch(outputs)
    scheduled = {req_id: [-1] * len(spec or ())
                 for req_id, spec in zip(batch.req_ids, batch.spec_token_ids, strict=False)
                 if req_id is not None}
    for req_id in scheduled:
        input_batch.update_req_spec_token_ids(states[req_id], scheduled)
    input_batch.prev_req_id_to_index = dict(batch.prev_req_id_to_index)
    assert input_batch.sampling_metadata.spec_token_ids is input_batch.spec_token_ids
    assert len(input_batch.req_ids) == num_reqs
    return input_batch


# Output lists as the penalties see them: ids, trailing -1 placeholders, and
# the int-like objects numpy also accepts (bool, int subclasses, numpy ints).
PENALTY_ITEMS = st.one_of(
    st.integers(0, 151_935), st.integers(0, 151_935), st.just(-1),
    st.sampled_from([0, -2, 2**31, 2**62, -(2**63), 2**63 - 1, True, Token(-1),
                     Token(9), np.int64(12), np.int32(-1)]))


@st.composite
def penalty_rows(draw, max_reqs: int = 12, max_len: int = 40) -> list[list[int]]:
    rows = []
    for _ in range(draw(st.integers(0, max_reqs))):
        row = draw(st.lists(PENALTY_ITEMS, max_size=max_len))
        row += [-1] * draw(st.integers(0, 3))
        rows.append(tuple(row) if draw(st.integers(0, 9)) == 0 else row)
    return rows


def vllm_0_33_penalty_array(rows, vocab_size: int) -> np.ndarray:
    """vLLM 0.33.0's tensor for the penalties, as numpy: ``make_ndarray_with_pad``
    (vllm/utils/torch_utils.py, transcribed) and then ``apply_all_penalties``'
    ``masked_fill_(t == -1, vocab_size)``."""
    max_len = max(map(len, rows), default=0)
    padded = np.full((len(rows), max_len), vocab_size, dtype=np.int64)
    for ind, blocktb in enumerate(rows):
        assert len(blocktb) <= max_len
        padded[ind, :len(blocktb)] = blocktb
    padded[padded == -1] = vocab_size
    return padded
