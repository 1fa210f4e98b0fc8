"""Workspace-level end-to-end tests (a package, so its conftest does not shadow
bindings/python/tests/conftest.py when both run in one pytest session)."""
