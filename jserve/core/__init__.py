"""Layer: core (policy, pure Python: stdlib and numpy, never jax). Requests and their stop
rules, the block manager and prefix cache, the planner and scheduler, lanes, tenants and fair
share, admission and deadlines, buckets, step costs, run-time control. docs/architecture.md."""
