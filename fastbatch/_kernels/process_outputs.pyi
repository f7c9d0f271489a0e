from typing import Any

__all__ = ["process_output"]

def bind(
    output_type: type,
    processor_type: type,
    state_type: type,
    logprobs_type: type,
    detokenizer_types: tuple[type, ...],
    stop: Any,
    final_only: Any,
) -> None: ...
def process_output(
    processor: Any,
    output: Any,
    engine_core_timestamp: Any,
    iteration_stats: Any,
    weight_version: Any,
    request_outputs: list[Any],
    reqs_to_abort: list[Any],
    outputs: Any = None,
) -> bool: ...
def stats() -> dict[str, int]: ...
def reset_stats() -> None: ...
