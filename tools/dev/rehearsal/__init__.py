"""The rehearsal of the reference serve command (DP 2 x TP 8 + EP, W8A8,
graph capture sizes; at DP 2 x TP 2) at GLM-4.5's depth through the
torch_npu double: ``python -m tools.dev.rehearsal`` (``make rehearsal``).
``depth`` builds the checkpoint; ``unbounded/`` goes on the PYTHONPATH of the
``mtp-unbounded`` run only."""
