from typing import Any

def append_sampled_token_ids(
    req_ids: list[str | None],
    requests: dict[str, Any],
    num_sampled_tokens: int,
    valid_sampled_token_ids: list[list[int]] | None,
    discarded: set[int] | frozenset[int] | None,
    num_tokens_no_spec: Any,
    token_ids_cpu: Any,
    is_token_ids: Any,
    max_model_len: int,
) -> int: ...
def stats() -> dict[str, int]: ...
def reset_stats() -> None: ...
