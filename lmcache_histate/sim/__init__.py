"""Trace-driven simulator that drives the same policy core as the live backend."""
