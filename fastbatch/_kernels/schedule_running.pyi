from typing import Any

def schedule_running_requests(scheduler: Any, req_index: int, token_budget: int,
                              input_budget: int, draft_slots: int,
                              long_prefill_token_threshold: int, defer_prefills: bool,
                              prefill_scheduled: bool, drafts_needed: bool | None,
                              scheduled_running_reqs: list[Any],
                              req_to_new_blocks: dict[str, Any],
                              num_scheduled_tokens: dict[str, int],
                              scheduled_spec_decode_tokens: dict[str, list[int]],
                              kinds: tuple[Any, Any, type, tuple[Any, ...]],
                              ) -> tuple[int, int, int, bool, bool | None]: ...
def stats() -> dict[str, int]: ...
def reset_stats() -> None: ...
