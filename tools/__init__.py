"""The repository's tools, as packages by audience; run each from the
repository root with ``python -m``:

- ``tools.bench``: benchmarks (``python -m tools.bench.mtp``, ``.graph_modes``,
  ``.parallel``, ``.quantization``) over the library in ``tools.bench.run``.
- ``tools.nightly``: the nightly regression gate (``python -m tools.nightly``).
- ``tools.demo``: ``make demo``'s steps (``python -m tools.demo.serve``,
  ``python -m tools.demo.spec_config``).
- ``tools.quantize``: W8A8 quantization of a float checkpoint
  (``python -m tools.quantize.w8a8``).
- ``tools.reference``: the offline GLM-4.5 + MTP reference that the nightly
  and the tests compare against (``python -m tools.reference``).
- ``tools.dev``: repository infrastructure (the patched vLLM tree, the
  rebase check, the torch_npu double's hook) and the rehearsal of the
  reference serve command (``python -m tools.dev.rehearsal``).

This file and ``tools/dev/__init__.py`` import nothing: ``make`` runs
``python3 -m tools.dev.vllm_tree`` with the system Python before the venv
exists.
"""
