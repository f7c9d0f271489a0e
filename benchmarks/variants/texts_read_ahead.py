"""``piece_ab.py --variant``: the texts read ahead at the engine's start, and without them.

    python benchmarks/piece_ab.py --piece process_outputs update_sample_logprobs \
        detokenizer_update --settings logprobs=1 --vocab 32000 --cold \
        --variant benchmarks/variants/texts_read_ahead.py

With ``--cold`` every generate starts as a new process's first one
(``_texts.forget()``).  Side "on": the texts are read ahead
as the output processor's construction reads them (``prewarm``), so the
steps decode no text on first sight; side "off": nothing is read ahead, and
each id's text is decoded the first time a step meets it.  The texts are the
same both ways.
"""

from typing import Any

from fastbatch.patches import _texts

_PREWARM = _texts.prewarm


def read_ahead() -> None:
    _texts.prewarm = _PREWARM


def _nothing_read(tokenizer: Any) -> int:
    return 0


def met_on_first_sight() -> None:
    _texts.prewarm = _nothing_read


VARIANTS = {"texts read ahead": read_ahead, "texts on first sight": met_on_first_sight}
