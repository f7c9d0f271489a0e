from typing import Any

__all__ = ["update_sample_logprobs"]

def bind(stock: Any, entry_of: Any, convert: Any, kinds: tuple[type, type]) -> None: ...
def update(self: Any, logprobs_lists: Any) -> None: ...

def update_sample_logprobs(
    processor: Any,
    logprobs_lists: tuple[Any, Any, Any, Any],
    texts: dict[int, str],
    convert: Any,
    kinds: tuple[type, type],
    correct: Any = None,
) -> int: ...
def stats() -> dict[str, int]: ...
def reset_stats() -> None: ...
