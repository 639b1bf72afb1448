"""Benchmarks: quality under the evaluation protocol, kernels, and the ``kvstack bench`` harness."""
