from typing import Any

__all__ = ["create_chat_logprobs"]

def create_chat_logprobs(
    token_ids: list[int] | tuple[int, ...],
    top_logprobs: Any,
    tokenizer: Any,
    limit: int | None,
    as_token_id: bool,
    kinds: tuple[type, type, type],
) -> Any: ...
def stats() -> dict[str, int]: ...
def reset_stats() -> None: ...
