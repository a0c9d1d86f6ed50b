"""The LMCache server side of HiState: launcher, runtime, disk tier, plugins, shared index."""
