"""Benchmarks: pytest-benchmark suites (``python -m pytest bench/``) and the side-by-side showcase
(``python -m bench``)."""
