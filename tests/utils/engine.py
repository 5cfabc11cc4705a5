"""Helpers for end-to-end tests: engines in subprocesses, HF references."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# The engine process: ``python -m tests.utils.run_engine SPEC`` from the
# repository root (so that a job's ``setup`` module imports).
RUNNER = [sys.executable, "-m", "tests.utils.run_engine"]


def run_engine(engine: dict, prompts: list[list[int]], sampling,
               env: dict | None = None, timeout: int = 600,
               inspect: bool = False, setup: str | None = None,
               log_match: str | None = None) -> dict:
    """Generate with vLLM (through our plugin) in a fresh process; with
    ``inspect``, also report the runner's KV cache and draft weights; with
    ``log_match``, the engine's log lines holding it (``"log"``)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json",
                                     delete=False) as spec:
        json.dump({"engine": engine, "prompts": prompts,
                   "sampling": sampling, "inspect": inspect,
                   "setup": setup}, spec)
    # In-process engine core: faster to start; patch 0004 makes it deliver
    # drafts like the multiprocess one.
    full_env = {**os.environ, "VLLM_ASCEND_DEVICE": "cpu",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
    proc = subprocess.run([*RUNNER, spec.name], capture_output=True,
                          text=True, env=full_env, timeout=timeout, cwd=ROOT)
    os.unlink(spec.name)
    if proc.returncode != 0:
        raise AssertionError(f"engine failed:\n{proc.stderr[-6000:]}")
    # The last JSON line: a worker process may log after it.
    result = json.loads(next(line for line in reversed(
        proc.stdout.strip().splitlines()) if line.startswith("{")))
    if log_match is not None:
        result["log"] = [
            line for line in (proc.stdout + proc.stderr).splitlines()
            if log_match in line
        ]
    return result


def run_engines(jobs: dict, workers: int = 2) -> dict:
    """``run_engine`` for each ``{key: kwargs}`` job, ``workers`` engines at
    a time with one torch thread each; ``{key: result}``, or the
    AssertionError of an engine that failed."""
    from concurrent.futures import ThreadPoolExecutor

    def one(kwargs: dict):
        env = {"OMP_NUM_THREADS": "1", **(kwargs.pop("env", None) or {})}
        try:
            return run_engine(**kwargs, env=env)
        except AssertionError as failure:
            return failure

    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {key: pool.submit(one, dict(kwargs))
                   for key, kwargs in jobs.items()}
        return {key: future.result() for key, future in futures.items()}


def hf_greedy(model_dir: Path, prompts: list[list[int]],
              max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations from transformers' Glm4MoeForCausalLM."""
    from transformers import Glm4MoeForCausalLM
    model = Glm4MoeForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    # vLLM runs with ignore_eos: so must the reference.
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]),
                                 max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
            outs.append(out[0, len(ids):].tolist())
    return outs
