"""``piece_ab.py --variant``: the output processor's step borrow, and without it.

    python benchmarks/piece_ab.py --piece process_outputs update_sample_logprobs \
        detokenizer_update --settings logprobs=1 --vocab 32000 --cold \
        --variant benchmarks/variants/step_lending.py

Inside a step of the piece ``process_outputs``, ``_texts.lent``
gives the texts not yet in the table, and the U+FFFD corrections, one copy
borrowed from vLLM's tokenizer pool for the whole step (side "on"); the side
"off" gives them the pool tokenizer itself, which borrows a copy for every
call, as vLLM does.  The texts are the same both ways.
"""

from typing import Any

from fastbatch.patches import _texts

_LENT = _texts.lent


def borrowed_once_a_step() -> None:
    _texts.lent = _LENT


def _pool_tokenizer(tokenizer: Any) -> Any:
    return tokenizer


def borrowed_every_call() -> None:
    _texts.lent = _pool_tokenizer


VARIANTS = {"one borrow a step": borrowed_once_a_step,
            "a borrow a call": borrowed_every_call}
