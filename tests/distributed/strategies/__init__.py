"""The feature modules of worker_strategies.py (one file per feature, each registering its
subtests with the harness when imported; the worker's docstring says what they compare and how),
and ``common.py``, what several of them share (a helper: it registers no subtest)."""
