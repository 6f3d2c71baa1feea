"""Benchmarks (not timed tests): protected vs unprotected, side by side, in one run.

``bench/timing.py`` holds the shared timing helpers; ``bench/gemm.py`` is the GEMM benchmark CLI.
See docs/design.md, Performance method.
"""
