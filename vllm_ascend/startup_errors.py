"""Configuration errors from the ``vllm`` CLI as one clear message.

A wrong flag or environment variable (an unknown ``VLLM_ASCEND_DEVICE``, a
speculative method the checkpoint cannot run, a checkpoint missing tensors)
raises ``ValueError`` while the server is being configured. Python then
prints a 40-60 line traceback through uvloop, pydantic and vLLM's engine
setup, with the message at the bottom and, for pydantic, wrapped in
``[type=value_error, input_value=ArgsKwargs(...)]``. ``install()`` makes
the ``vllm`` command print just the message and exit with status 1; set
``VLLM_ASCEND_TRACEBACK=1`` for the full traceback.
"""

import sys
from pathlib import Path
from types import TracebackType
from typing import Optional

from vllm_ascend import envs

TRACEBACK_ENV = envs.VLLM_ASCEND_TRACEBACK_ENV


def error_messages(exc: BaseException) -> list[str]:
    """The user-facing messages of a configuration error."""
    errors = getattr(exc, "errors", None)
    if callable(errors) and type(exc).__name__ == "ValidationError":
        messages = []
        for err in errors():
            msg = str(err.get("msg", ""))
            # pydantic prefixes validator messages with "Value error, ".
            messages.append(msg.removeprefix("Value error, "))
        return messages or [str(exc)]
    return [str(exc)]


def _hook(exc_type: type[BaseException], exc: BaseException,
          tb: Optional[TracebackType]) -> None:
    if not isinstance(exc, ValueError) or envs.VLLM_ASCEND_TRACEBACK:
        sys.__excepthook__(exc_type, exc, tb)
        return
    for message in error_messages(exc):
        print(f"Error: {message}", file=sys.stderr)
    print(f"(set {TRACEBACK_ENV}=1 for the traceback)", file=sys.stderr)


def install() -> None:
    """Shorten uncaught configuration errors, in the ``vllm`` CLI only (not
    in scripts that import vLLM, whose authors want their tracebacks)."""
    if Path(sys.argv[0]).name == "vllm":
        sys.excepthook = _hook
