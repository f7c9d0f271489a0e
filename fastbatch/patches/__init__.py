"""One module per vLLM patch target; each says what it replaces, why, and when
it can go, and applies its patch idempotently behind a version/shape guard."""
