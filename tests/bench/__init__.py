"""Benchmark command tests.

A package (like tests/compose) so that its conftest imports as `bench.conftest` and does not
replace the top-level `conftest` module the other tests import helpers from.
"""
