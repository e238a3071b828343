"""Scheduling policy in pure Python (stdlib + numpy only, never jax): docs/architecture.md."""
