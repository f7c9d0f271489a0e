from typing import Any

def update_async_output_token_ids(
    req_ids: list[str | None],
    prev_req_id_to_index: dict[str, int],
    output_token_ids: list[list[int] | None],
    sampled_token_ids: Any,
    copy_ready: Any = ...,
) -> int: ...
def update_async_spec_token_ids(
    req_ids: list[str | None],
    prev_req_id_to_index: dict[str, int],
    spec_token_ids: list[list[int] | None],
    draft_token_ids: list[list[int] | None],
) -> int: ...
def output_tokens_tensor(
    output_token_ids: list[list[int]],
    vocab_size: int,
    pin_memory: bool = False,
) -> Any: ...
def _fill_output_tokens(
    output_token_ids: list[list[int]], vocab_size: int, out: Any
) -> Any: ...
def stats() -> dict[str, int]: ...
def reset_stats() -> None: ...
