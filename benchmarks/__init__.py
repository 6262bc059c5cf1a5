"""pytest-benchmark files, one per op (a package so that they can import the helpers in conftest)."""
