"""Pure, deterministic HiState policy core (no I/O, injected clock)."""
