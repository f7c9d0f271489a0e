"""Instructions of the compiled ``update_sample_logprobs`` call, counted by callgrind.

    valgrind --tool=callgrind python benchmarks/callgrind_update_sample_logprobs.py 1
    valgrind --tool=callgrind python benchmarks/callgrind_update_sample_logprobs.py 0

The first runs 256 stand-in processors (``logprobs=1``, a hot table, one
position a call, the sampled id also the top one, as greedy sampling makes
it) for 21 calls each; the second only builds them.  The difference of the
two "Collected" counts over 256 x 21 is the instructions a call, the loop
around it included.  No vLLM is needed: the ``Logprob`` is vLLM's dataclass
of three fields transcribed.  Instruction counts are steady where times on
these shared machines are not.
"""

from __future__ import annotations

import dataclasses
import sys

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
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    texts = {token: f"t{token}" for token in range(100, 100 + PROCESSORS)}
    processors = [Processor() for _ in range(PROCESSORS)]
    lists = [(np.array([[token, token]], dtype=np.int64)[0:1],
              np.array([[-0.5, -0.5]], dtype=np.float32)[0:1], np.array([1])[0:1], None)
             for token in texts]
    update = fastbatch._kernels.update_sample_logprobs
    kinds = (Logprob, Flat)
    for _ in range(CALLS if calls else 0):
        for processor, arrays in zip(processors, lists, strict=True):
            update(processor, arrays, texts, None, kinds)


if __name__ == "__main__":
    main()
