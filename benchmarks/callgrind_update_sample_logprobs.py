"""Instructions of the compiled ``update_sample_logprobs`` call, counted by callgrind.

    PYTHONHASHSEED=0 valgrind --tool=callgrind \
        --toggle-collect='__pyx_pw_*update_sample_logprobs_*update_sample_logprobs' \
        python benchmarks/callgrind_update_sample_logprobs.py

256 stand-in processors (``logprobs=1``, a hot table, one position a call,
the sampled id also the top one, as greedy sampling makes it), 21 calls
each; callgrind collects only inside the compiled call, so "Collected" over
256 x 21 is its instructions a call.  No vLLM is needed: the ``Logprob`` is
vLLM's dataclass of three fields transcribed.  Instruction counts are
steady where times on these shared machines are not (the whole process's
count moves by millions with the hash seed, hence the toggle and the seed).
"""

from __future__ import annotations

import dataclasses

import numpy as np

import fastbatch

PROCESSORS, CALLS = 256, 21


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class Flat:
    """Never the container here."""


class Processor:
    def __init__(self) -> None:
        self.tokenizer = "a tokenizer"
        self.logprobs: list = []
        self.prompt_logprobs = None
        self.cumulative_logprob = 0.0
        self.num_logprobs = 1


def main() -> None:
    texts = {token: f"t{token}" for token in range(100, 100 + PROCESSORS)}
    processors = [Processor() for _ in range(PROCESSORS)]
    lists = [(np.array([[token, token]], dtype=np.int64)[0:1],
              np.array([[-0.5, -0.5]], dtype=np.float32)[0:1], np.array([1])[0:1], None)
             for token in texts]
    update = fastbatch._kernels.update_sample_logprobs
    kinds = (Logprob, Flat)
    for _ in range(CALLS):
        for processor, arrays in zip(processors, lists, strict=True):
            update(processor, arrays, texts, None, kinds)


if __name__ == "__main__":
    main()
