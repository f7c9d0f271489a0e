from typing import Any

def update_async_output_token_ids(
    req_ids: list[str | None],
    prev_req_id_to_index: dict[str, int],
    output_token_ids: list[list[int] | None],
    sampled_token_ids: Any,
    copy_ready: Any = ...,
) -> int: ...
def stats() -> dict[str, int]: ...
def reset_stats() -> None: ...
