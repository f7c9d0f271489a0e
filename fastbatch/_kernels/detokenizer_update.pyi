from collections.abc import Callable
from typing import Any

__all__ = ["update_detokenizer"]

def update_detokenizer(
    detokenizer: Any,
    new_token_ids: list[int],
    stop_terminated: bool,
    check_stop_strings: Callable[..., tuple[str, int] | None],
) -> str | None: ...
def stats() -> dict[str, int]: ...
def reset_stats() -> None: ...
