"""The test suite's shared harness: engines in subprocesses, checkpoints,
the NPU code paths. Helpers used by one test folder stay in that folder."""
