"""Benchmarks: ``run`` (configurations, runs, prompts: the library), the
per-engine child process (``engine_child``), metric arithmetic (``stats``)
and the report (``report``: table, JSON, plot); ``mtp``, ``graph_modes``,
``parallel`` and ``quantization`` are the command lines
(``python -m tools.bench.mtp``)."""
