"""``python -m bench``: every step side by side, on one of four workloads (``bench/workloads/``),
beside other engines on the same weights (``bench/peers/``). The pytest-benchmark suites live
apart, in ``bench/suites/``: ``python -m pytest bench/suites/test_ops.py``."""
