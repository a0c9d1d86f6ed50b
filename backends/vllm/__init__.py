"""The vLLM side of HiState: connector, interval saves, plan client, engine facts, serve."""
