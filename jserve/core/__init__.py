"""Scheduling policy in pure Python (stdlib + numpy only, never jax): see DESIGN.md."""
