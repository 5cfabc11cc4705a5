"""Helpers of ``tools/benchmark_mtp.py``: the per-engine child process,
metric arithmetic and the report (table, JSON, plot)."""
