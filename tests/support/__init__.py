"""Test support code shared by the test suites (real harnesses, no mocks)."""
