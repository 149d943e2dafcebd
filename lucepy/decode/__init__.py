"""Samplers and decode loops."""
