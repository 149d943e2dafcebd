"""Prefix snapshots: RAM slots, the disk format, and the policy that decides what to keep.

Engines with a prefix cache attached are opened by ``lucepy.engine.open_engine``."""
