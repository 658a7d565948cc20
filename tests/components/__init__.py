"""Tests of the built-in components (helpers: tests/helpers/components.py)."""
