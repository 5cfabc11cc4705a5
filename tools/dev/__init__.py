"""Repository infrastructure, run by the Makefile: the patched vLLM tree
(``vllm_tree``, ``fetch_vllm_sdist``), the rebase check (``rebase_check``),
the torch_npu double's ``.pth`` hook (``install_npu_double``), and the
rehearsal of the reference serve command at GLM-4.5's depth
(``rehearsal``, ``make rehearsal``).

Imports nothing: ``vllm_tree`` and ``fetch_vllm_sdist`` run with the system
Python (standard library only) before the venv exists."""
