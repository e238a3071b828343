"""jserve's benchmarks: each module a script, run from the repository root as
`python -m bench.NAME` (bench.serve, bench.serve_compare, bench.peer_compare, ...).

Not part of the installed package. What the scripts share lives here once: the workloads
(bench.workloads), the report writer for tables, JSON and plots (bench.report_writer), and
the A/B driver for scripts that compare two things (bench.ab_driver). Results go under
bench/results/; bench/RESULTS.md records what they measured and the commands that did.
"""
