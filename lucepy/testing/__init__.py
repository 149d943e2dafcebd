"""Helpers for tests and benchmarks: tiny random-weight model files and the like."""
