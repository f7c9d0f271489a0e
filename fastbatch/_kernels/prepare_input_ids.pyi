from typing import Any

def prepare_input_ids_indices(
    req_ids: list[str | None],
    prev_positions: object,
    cu_num_tokens: object,
    scheduled_spec_tokens: dict[str, list[int]],
    prev_num_spec_tokens: int,
    num_reqs: int,
) -> tuple[Any, Any, bool, int]: ...
def stats() -> dict[str, int]: ...
def reset_stats() -> None: ...
