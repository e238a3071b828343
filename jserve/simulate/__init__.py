"""The capacity simulator: the real jserve.core scheduler driven in virtual time by a cost model.

Pure Python (no JAX, no model): `jserve simulate` (jserve.simulate.cli) replays a workload or
a preset comparison in seconds. docs/scheduling.md describes it.
"""
