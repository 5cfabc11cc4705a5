"""Environment variables read by vllm_ascend, in one place.

As in ``vllm/envs.py``: each variable has one entry in
``environment_variables`` (name, default, what it does), read lazily as a
module attribute (``envs.VLLM_ASCEND_MAX_N``) so that a test's
``monkeypatch.setenv`` takes effect at once. One parser per kind: a flag is
on with "1" only; a positive integer that is not one is a ``ValueError``
naming the variable and what it holds.

Not here: vLLM's own variables (``vllm.envs``, e.g. VLLM_CPU_KVCACHE_SPACE),
the HCCL/CANN ones the NPU runtime reads, and the test-only torch_npu
double's ``VLLM_ASCEND_NPU_DOUBLE_*`` (tests/npu_double).
"""

import os
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    VLLM_ASCEND_DEVICE: str = "auto"
    VLLM_ASCEND_NPU_DOUBLE: bool = False
    VLLM_ASCEND_SKIP_CHECKPOINT_CHECK: bool = False
    VLLM_ASCEND_MAX_N: int = 128
    VLLM_ASCEND_TRACEBACK: bool = False
    VLLM_ASCEND_MOE_COMM: Optional[str] = None
    VLLM_ASCEND_MC2_CAPACITY: int = 256

# Names for messages and for tests that set the variables.
VLLM_ASCEND_DEVICE_ENV = "VLLM_ASCEND_DEVICE"
VLLM_ASCEND_NPU_DOUBLE_ENV = "VLLM_ASCEND_NPU_DOUBLE"
VLLM_ASCEND_SKIP_CHECKPOINT_CHECK_ENV = "VLLM_ASCEND_SKIP_CHECKPOINT_CHECK"
VLLM_ASCEND_MAX_N_ENV = "VLLM_ASCEND_MAX_N"
VLLM_ASCEND_TRACEBACK_ENV = "VLLM_ASCEND_TRACEBACK"
VLLM_ASCEND_MOE_COMM_ENV = "VLLM_ASCEND_MOE_COMM"
VLLM_ASCEND_MC2_CAPACITY_ENV = "VLLM_ASCEND_MC2_CAPACITY"

DEFAULT_MAX_N = 128
DEFAULT_MC2_CAPACITY = 256


def _flag(name: str) -> Callable[[], bool]:
    """On with "1"; unset or any other value is off."""
    return lambda: os.environ.get(name, "0") == "1"


def _word(name: str, default: str) -> Callable[[], str]:
    """A lower-case word; the reader checks it against its choices (and
    names them in its own error)."""
    return lambda: os.environ.get(name, default).strip().lower()


def _positive_int(name: str, default: int,
                  what: str) -> Callable[[], int]:
    """A positive integer; anything else raises one line naming the
    variable and what it holds."""

    def parse() -> int:
        raw = os.environ.get(name, str(default))
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(
                f"{name}={raw!r} must be a positive integer ({what}).")
        return value

    return parse


environment_variables: dict[str, Callable[[], Any]] = {
    # Device. "auto" (default): npu when torch_npu imports and sees a
    # device, else the CPU reference device. "npu" or "cpu" forces one
    # (vllm_ascend/device.py rejects anything else).
    VLLM_ASCEND_DEVICE_ENV:
    _word(VLLM_ASCEND_DEVICE_ENV, "auto"),

    # "1": ``import torch_npu`` finds the test-only contract double of
    # tests/npu_double (the dev install puts it on sys.path) and, with
    # VLLM_ASCEND_DEVICE=npu, the plugin takes its NPU code paths with CPU
    # tensors underneath. For CI on machines without an NPU.
    VLLM_ASCEND_NPU_DOUBLE_ENV:
    _flag(VLLM_ASCEND_NPU_DOUBLE_ENV),

    # "1" skips the startup check that a local GLM-4.5 checkpoint holds
    # every tensor its config needs. vLLM's own tests of the patch series
    # build partial checkpoints on purpose (tools/dev/vllm_tree.py sets it for
    # them).
    VLLM_ASCEND_SKIP_CHECKPOINT_CHECK_ENV:
    _flag(VLLM_ASCEND_SKIP_CHECKPOINT_CHECK_ENV),

    # The most completions (``n``) one request may ask for (default 128).
    # A request's n child sequences are created up front, before any is
    # scheduled: an unbounded n (say 10**6) stalls the server for everyone.
    # A larger n gets HTTP 400 (vllm_ascend/checks.py).
    VLLM_ASCEND_MAX_N_ENV:
    _positive_int(VLLM_ASCEND_MAX_N_ENV, DEFAULT_MAX_N,
                  "the most completions one request may ask for"),

    # "1": the ``vllm`` CLI prints the full traceback of a configuration
    # error instead of its one-line message (vllm_ascend/startup_errors.py).
    VLLM_ASCEND_TRACEBACK_ENV:
    _flag(VLLM_ASCEND_TRACEBACK_ENV),

    # Forces the MoE communication method: allgather, alltoall or mc2
    # (unset: chosen per step, vllm_ascend/distributed/moe_comm). A forced
    # method that cannot run in the configuration fails at startup.
    VLLM_ASCEND_MOE_COMM_ENV:
    lambda: _word(VLLM_ASCEND_MOE_COMM_ENV, "")() or None,

    # Tokens per rank the MC2 buffers hold (default 256): MC2 runs a step
    # whose largest DP batch fits, all-gather a larger one.
    VLLM_ASCEND_MC2_CAPACITY_ENV:
    _positive_int(VLLM_ASCEND_MC2_CAPACITY_ENV, DEFAULT_MC2_CAPACITY,
                  "tokens per rank the MC2 buffers hold"),
}


def __getattr__(name: str):
    # lazy evaluation of environment variables
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return list(environment_variables.keys())


def is_set(name: str) -> bool:
    """Whether an environment variable is explicitly set."""
    if name in environment_variables:
        return name in os.environ
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The functions other modules call.
def requested_device() -> str:
    return environment_variables[VLLM_ASCEND_DEVICE_ENV]()


def skip_checkpoint_check() -> bool:
    return environment_variables[VLLM_ASCEND_SKIP_CHECKPOINT_CHECK_ENV]()


def npu_double() -> bool:
    return environment_variables[VLLM_ASCEND_NPU_DOUBLE_ENV]()
