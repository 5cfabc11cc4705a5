"""Data-parallel engines for end-to-end tests: one process per DP rank.

vLLM 0.11 has no offline ``LLM(data_parallel_size=N)``; its offline DP
pattern is one ``LLM`` per rank, each told its rank by ``VLLM_DP_*``
environment variables, which is what this helper starts (each rank runs
``run_engine.py`` with the in-process engine core). Every rank gets its own
prompts; a rank with none still steps (dummy batches) while the others
decode. All processes are killed when one fails or the time is up, so a
hung collective fails the test instead of hanging it.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time

from tests.utils.engine import ROOT, RUNNER


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def run_dp_engine(engine: dict, prompts_per_rank: list[list[list[int]]],
                  sampling_per_rank: list, env: dict | None = None,
                  timeout: float = 300) -> list[dict]:
    """Generate with ``len(prompts_per_rank)`` DP ranks; return each rank's
    ``{"outputs": ..., "metrics": ...}`` in rank order. A rank's sampling
    is what ``run_engine.py`` takes: one dict, or one per prompt."""
    if len(sampling_per_rank) != len(prompts_per_rank):
        raise ValueError(
            f"{len(prompts_per_rank)} ranks of prompts but "
            f"{len(sampling_per_rank)} of sampling parameters; give one "
            "sampling entry per rank.")
    dp_size = len(prompts_per_rank)
    base_env = {**os.environ, "VLLM_ASCEND_DEVICE": "cpu",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
                "VLLM_DP_SIZE": str(dp_size),
                "VLLM_DP_MASTER_IP": "127.0.0.1",
                "VLLM_DP_MASTER_PORT": str(_free_port()), **(env or {})}
    procs: list[subprocess.Popen] = []
    files = []
    try:
        for rank, (prompts, sampling) in enumerate(
                zip(prompts_per_rank, sampling_per_rank)):
            with tempfile.NamedTemporaryFile("w", suffix=".json",
                                             delete=False) as spec:
                json.dump({"engine": engine, "prompts": prompts,
                           "sampling": sampling}, spec)
            out = tempfile.TemporaryFile("w+")  # noqa: SIM115
            err = tempfile.TemporaryFile("w+")  # noqa: SIM115
            files.append((spec.name, out, err))
            rank_env = dict(base_env, VLLM_DP_RANK=str(rank),
                            VLLM_DP_RANK_LOCAL=str(rank))
            procs.append(subprocess.Popen(
                [*RUNNER, spec.name], stdout=out, stderr=err, env=rank_env,
                start_new_session=True, cwd=ROOT))
        deadline = time.monotonic() + timeout
        timed_out = False
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.5)
        _kill(procs)
        errors = []
        results = []
        for rank, (proc, (_, out, err)) in enumerate(zip(procs, files)):
            out.seek(0)
            err.seek(0)
            if proc.returncode != 0:
                errors.append(f"--- DP rank {rank} (exit {proc.returncode})"
                              f":\n{err.read()[-4000:]}")
            else:
                # The last JSON line: TP workers may log after it.
                results.append(json.loads(next(
                    line for line in reversed(out.read().strip().splitlines())
                    if line.startswith("{"))))
        if errors:
            what = (f"hung: not done after {timeout}s" if timed_out else
                    "failed")
            raise AssertionError(f"DP={dp_size} engine {what}\n" +
                                 "\n".join(errors))
        return results
    finally:
        _kill(procs)
        for name, out, err in files:
            os.unlink(name)
            out.close()
            err.close()
