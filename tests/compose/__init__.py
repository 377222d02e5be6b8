"""Compose integration tests (marker `compose`): the demo stack and fault injection in Docker.

A package (unlike the other test folders) so that its conftest imports as `compose.conftest`
and does not replace the top-level `conftest` module the other tests import helpers from.
"""
