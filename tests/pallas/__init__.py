"""Kernel tests (a package, so names like test_bench_smoke cannot clash with other suites)."""
