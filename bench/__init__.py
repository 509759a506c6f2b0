"""Benchmarks: pytest-benchmark suites (``pytest bench/``) and the side-by-side showcase
(``python -m bench``)."""
