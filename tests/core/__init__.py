"""Scheduling-core tests (a package, so their module names cannot clash with other suites')."""
