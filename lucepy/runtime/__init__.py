"""Devices, shards, the pipeline and per-layer state."""
