"""One engine configuration of the benchmark, in its own process.

Usage: ``python -m tools.bench.engine_child SPEC.json`` with the repository
root on PYTHONPATH (``tools.bench.run.child_command`` and ``child_env``).
The root's ``vllm/`` folder does not shadow vLLM there: the regular package
that ``make install``'s ``vllm-tree.pth`` puts on ``sys.path`` wins over a
namespace package. Progress lines start with ``PROGRESS `` and the
last line with ``RESULT ``, each followed by JSON. A fresh process per
configuration keeps distributed state and peak memory per configuration;
the parent runs vLLM's engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the peak RSS measured here
covers the model, the drafter and the KV cache.
"""

import itertools
import json
import resource
import sys
import time
from typing import Any, Optional

import torch

from tools.bench import collectives
from tools.bench.stats import (ACCEPTED, ACCEPTED_PER_POS, DECODE_TIME,
                               DRAFT_TOKENS, DRAFTS, acceptance,
                               decode_tokens_per_s, median, metric_delta)

HISTOGRAMS = (DECODE_TIME, )
RETRIES = 3
# The speculation watchdog's metrics (vLLM patch 0011): a counter of pauses
# and a gauge, 1 while speculation is paused.
PAUSES = "vllm:spec_decode_num_pauses"
PAUSED = "vllm:spec_decode_paused"
# Its --speculative-config keys, reported as the engine resolved them.
WATCHDOG_KEYS = ("fallback_acceptance_floor", "fallback_relative_floor",
                 "fallback_window", "fallback_probe_interval")


def emit(kind: str, payload: dict[str, Any]) -> None:
    print(f"{kind} {json.dumps(payload)}", flush=True)


def snapshot(llm) -> dict[str, Any]:
    """Spec-decode counters and vectors, and decode-time histograms (summed
    over label sets) at this moment."""
    out: dict[str, Any] = {}
    for metric in llm.get_metrics():
        name = metric.name
        if name in HISTOGRAMS:
            old = out.get(name, {"sum": 0.0, "count": 0})
            out[name] = {"sum": old["sum"] + metric.sum,
                         "count": old["count"] + metric.count}
        elif name.startswith("vllm:spec_decode"):
            values = getattr(metric, "values", None)
            if values is not None:
                old = out.get(name, [0] * len(values))
                out[name] = [a + b for a, b in zip(old, values)]
            else:
                out[name] = out.get(name, 0) + metric.value
    return out


def _weights_bytes(worker) -> dict[str, int]:
    """Bytes of the parameters and buffers of the target model and of the
    drafter; tensors the drafter shares with the target count once."""
    runner = worker.model_runner
    seen: set[int] = set()

    def size(module) -> int:
        total = 0
        tensors = itertools.chain(module.parameters(), module.buffers())
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return total

    target = size(runner.model)
    drafter = getattr(runner, "drafter", None)
    draft_model = getattr(drafter, "model", None)
    return {"target": target,
            "drafter": size(draft_model) if draft_model is not None else 0}


def _install_forward_timers(worker) -> bool:
    """Time every forward of the target model and of the draft model (hooks
    in the worker; the engine core runs in this process)."""
    runner = worker.model_runner
    stats: dict[str, dict[str, float]] = {}

    def timed(name: str, module) -> None:
        rec = stats.setdefault(name, {"calls": 0, "seconds": 0.0})
        if not isinstance(module, torch.nn.Module):
            # A full-graph wrapper: a replay runs no module forward, so the
            # wrapper's calls are what is timed.
            base = type(module)

            def call(self, *args, **kwargs):
                start = time.perf_counter()
                try:
                    return base.__call__(self, *args, **kwargs)
                finally:
                    rec["calls"] += 1
                    rec["seconds"] += time.perf_counter() - start

            module.__class__ = type(f"Timed{base.__name__}", (base, ),
                                    {"__call__": call})
            return
        started: list[float] = []
        module.register_forward_pre_hook(
            lambda *_: started.append(time.perf_counter()))

        def done(*_) -> None:
            rec["calls"] += 1
            rec["seconds"] += time.perf_counter() - started.pop()

        module.register_forward_hook(done)

    timed("target", runner.model)
    drafter = getattr(runner, "drafter", None)
    if getattr(drafter, "model", None) is not None:
        timed("draft", drafter.model)
    worker.bench_forward_stats = stats
    return True


def _graph_info(worker) -> dict[str, Any]:
    """Graphs the plugin captured in this engine (target and draft)."""
    from vllm_ascend.compilation.graph_wrapper import graph_stats
    return {"captured": sum(graph_stats.captured.values()),
            "replayed": sum(graph_stats.replayed.values()),
            "pool_bytes": graph_stats.pool_bytes,
            "capture_s": graph_stats.capture_seconds}


def _draft_shares(worker) -> list[str]:
    """The target modules the MTP draft runs on (embed_tokens, lm_head)."""
    from vllm_ascend.spec_decode.mtp_proposer import shared_with_target
    runner = worker.model_runner
    drafter = getattr(runner, "drafter", None)
    if getattr(drafter, "model", None) is None:
        return []
    return shared_with_target(drafter.model, runner.model)


def _forward_stats(worker) -> dict[str, dict[str, float]]:
    return {k: dict(v) for k, v in worker.bench_forward_stats.items()}


def forward_time(before: dict, after: dict) -> dict[str, Any]:
    """Mean milliseconds per forward of the target and of the draft, and
    the draft's cost relative to the target's (what MTP adds per step)."""
    out: dict[str, Any] = {}
    for name in after:
        calls = after[name]["calls"] - before[name]["calls"]
        seconds = after[name]["seconds"] - before[name]["seconds"]
        out[f"{name}_calls"] = calls
        out[f"{name}_ms_per_forward"] = (1000 * seconds / calls
                                         if calls else None)
    if out.get("draft_ms_per_forward") and out.get("target_ms_per_forward"):
        out["draft_over_target"] = (out["draft_ms_per_forward"] /
                                    out["target_ms_per_forward"])
    return out


def host_ms_per_step(before: dict, after: dict, window_s: float):
    """Wall time of the timed runs outside the target and draft forwards
    (scheduling, input preparation, sampling, the drafter's bookkeeping),
    per target step."""
    steps = after["target"]["calls"] - before["target"]["calls"]
    if not steps:
        return None
    forwards = sum(after[name]["seconds"] - before[name]["seconds"]
                   for name in after)
    return 1000 * (window_s - forwards) / steps


def peak_rss_bytes() -> int:
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def timed_generate(llm, prompts, max_tokens: int):
    from vllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens,
                            ignore_eos=True, detokenize=False)
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    ids = [list(o.outputs[0].token_ids) for o in outputs]
    bad = [len(i) for i in ids if len(i) != max_tokens]
    if bad:
        raise RuntimeError(f"asked for {max_tokens} tokens with ignore_eos, "
                           f"got lengths {bad}")
    return elapsed, cpu, ids


def hist_delta(before: dict, after: dict, name: str) -> dict[str, float]:
    a = after.get(name, {"sum": 0.0, "count": 0})
    b = before.get(name, {"sum": 0.0, "count": 0})
    return {"sum": a["sum"] - b["sum"], "count": a["count"] - b["count"]}


def watchdog_state(before: dict, after: dict) -> Optional[dict[str, Any]]:
    """Pauses of the speculation watchdog between two snapshots, and
    whether speculation is paused at the second; None without its
    metrics (a vLLM without the watchdog)."""
    if PAUSES not in after and PAUSED not in after:
        return None
    return {"num_pauses": metric_delta(before, after, PAUSES),
            "paused": _paused(after)}


def _paused(metrics: dict) -> Optional[bool]:
    """The watchdog's gauge in a snapshot (None without it)."""
    paused = metrics.get(PAUSED)
    return None if paused is None else bool(paused)


def _draft_length_policy(llm):
    """The scheduler's adaptive draft length policy (vLLM patch 0013,
    ``adaptive_draft_length: true``), or None: without it, or with the
    engine core in another process."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    policy = getattr(scheduler, "draft_length_policy", None)
    return (scheduler, policy) if policy is not None else (None, None)


def install_draft_length_counter(llm) -> Optional[list[int]]:
    """With an adaptive draft length: count the decode steps (no prefill in
    the step) per draft length the scheduler gave the runner (0..k, a
    pause of the watchdog as 0), in a list that grows as the engine runs;
    None without an adaptive draft length."""
    scheduler, policy = _draft_length_policy(llm)
    if policy is None:
        return None
    steps = [0] * (policy.max_draft_length + 1)
    original = scheduler._observe_step_time

    def counted(scheduler_output) -> None:
        spec = scheduler_output.scheduled_spec_decode_tokens
        if all(n == 1 + len(spec.get(req_id, ())) for req_id, n in
               scheduler_output.num_scheduled_tokens.items()):
            length = scheduler_output.draft_length
            steps[policy.max_draft_length if length is None else length] += 1
        original(scheduler_output)

    scheduler._observe_step_time = counted
    return steps


def draft_length_state(llm, batch: int, steps_before: list[int],
                       steps_after: list[int]) -> dict[str, Any]:
    """The adaptive policy's choices between two counts (decode steps per
    draft length) and what it knows at the end: per draft length, the measured
    step time of this batch's bucket and its samples; per position, the
    acceptance given the one before; the expected tokens per request of a
    step verifying k drafts."""
    from vllm.v1.spec_decode.draft_length import batch_bucket
    _, policy = _draft_length_policy(llm)
    lengths = range(policy.max_draft_length + 1)
    times = {k: policy._times.get((batch_bucket(batch), k)) for k in lengths}
    return {
        "steps_per_length": [a - b for a, b in zip(steps_after,
                                                    steps_before)],
        "step_ms": [None if times[k] is None or not times[k][1] else
                    1000 * times[k][0] for k in lengths],
        "step_samples": [0 if times[k] is None else int(times[k][1])
                         for k in lengths],
        "acceptance_per_pos": [policy.acceptance(i)
                               for i in range(policy.max_draft_length)],
        "expected_tokens": [policy.expected_tokens(k) for k in lengths],
    }


def run_batch(llm, spec: dict, batch: int,
              draft_steps: Optional[list[int]] = None) -> dict[str, Any]:
    # Under data parallelism every rank must make the same generate calls
    # (their steps are collective): no re-measured pairs there.
    retries = spec.get("retries", RETRIES)
    base = spec["prompts"]
    prompts = [{"prompt_token_ids": base[i % len(base)]}
               for i in range(batch)]
    n = spec["new_tokens"]
    # The watchdog's pauses count from before the warm-up: a pause there
    # shapes the timed runs too.
    before_warmup = snapshot(llm)
    timed_generate(llm, prompts, spec["warmup_tokens"])
    start = snapshot(llm)
    steps_before = list(draft_steps or [])
    forwards_before = llm.collective_rpc(_forward_stats)[0]
    collectives_before = collectives.totals()
    window_start = time.perf_counter()
    runs = []
    decode_hist = {"sum": 0.0, "count": 0}
    outputs = None
    for repeat in range(spec["repeats"]):
        # A load spike on a shared host can make the 1-token run the slower
        # one; such a pair says nothing, so it is measured again.
        for attempt in range(1, retries + 1):
            t_one, cpu_one, _ = timed_generate(llm, prompts, 1)
            before = snapshot(llm)
            t_full, cpu_full, ids = timed_generate(llm, prompts, n)
            delta = hist_delta(before, snapshot(llm), DECODE_TIME)
            if t_full > t_one and cpu_full > cpu_one:
                break
        decode_hist = {k: decode_hist[k] + delta[k] for k in decode_hist}
        if outputs is not None and ids != outputs:
            raise RuntimeError(f"greedy outputs changed between repeats at "
                               f"batch {batch} (repeat {repeat})")
        outputs = ids
        runs.append({"t_full_s": t_full, "t_one_s": t_one,
                     "cpu_full_s": cpu_full, "cpu_one_s": cpu_one,
                     "attempts": attempt,
                     "decode_tokens_per_s":
                     decode_tokens_per_s(t_full, t_one, batch, n),
                     "decode_tokens_per_cpu_s":
                     decode_tokens_per_s(cpu_full, cpu_one, batch, n)})
    window = time.perf_counter() - window_start
    collectives_after = collectives.totals()
    end = snapshot(llm)
    forwards_after = llm.collective_rpc(_forward_stats)[0]
    result: dict[str, Any] = {
        "batch_size": batch,
        "forward_time": forward_time(forwards_before, forwards_after),
        "host_ms_per_step": host_ms_per_step(forwards_before, forwards_after,
                                             window),
        "runs": runs,
        "decode_tokens_per_s": median(
            [r["decode_tokens_per_s"] for r in runs]),
        "best_decode_tokens_per_s": max(
            r["decode_tokens_per_s"] for r in runs),
        "decode_tokens_per_cpu_s": median(
            [r["decode_tokens_per_cpu_s"] for r in runs]),
        "median_t_full_s": median([r["t_full_s"] for r in runs]),
        "median_t_one_s": median([r["t_one_s"] for r in runs]),
        "outputs": outputs,
    }
    if spec.get("collectives"):
        # Timed in this process: with the engine core in-process and one
        # worker (TP 1), every step's collectives.
        result["collective_share"] = (
            collectives_after["seconds"] - collectives_before["seconds"]
        ) / window
        result["collective_calls"] = (collectives_after["calls"] -
                                      collectives_before["calls"])
    # vLLM's own timing: per request, last token time - first token time.
    if decode_hist["count"]:
        mean_decode = decode_hist["sum"] / decode_hist["count"]
        result["vllm_request_decode_time_s"] = mean_decode
        result["vllm_decode_tokens_per_s"] = (
            batch * (n - 1) / mean_decode if mean_decode > 0 else None)
    if spec["num_speculative_tokens"]:
        result["acceptance"] = acceptance(
            metric_delta(start, end, DRAFTS) or 0,
            metric_delta(start, end, DRAFT_TOKENS) or 0,
            metric_delta(start, end, ACCEPTED) or 0,
            metric_delta(start, end, ACCEPTED_PER_POS))
        watchdog = watchdog_state(before_warmup, end)
        if watchdog is not None:
            result["watchdog"] = watchdog
    if draft_steps is not None:
        # The adaptive draft length's choices in the timed runs.
        result["draft_length"] = draft_length_state(llm, batch, steps_before,
                                                    draft_steps)
    return result


def _watchdog_settings(llm) -> Optional[dict[str, Any]]:
    """The watchdog's settings as the engine resolved them (None without
    speculative decoding or without the watchdog's keys)."""
    config = llm.llm_engine.vllm_config.speculative_config
    if config is None or not hasattr(config, WATCHDOG_KEYS[0]):
        return None
    return {key: getattr(config, key) for key in WATCHDOG_KEYS}


def setups(spec: dict) -> list[str]:
    """The spec's ``setup``: one "module:function" or a list of them."""
    value = spec.get("setup") or []
    return [value] if isinstance(value, str) else list(value)


def main(spec_path: str) -> None:
    from vllm import LLM

    with open(spec_path) as f:
        spec = json.load(f)
    for setup in setups(spec):
        # "module:function" called before the engine starts (the engine core
        # runs in this process): a deliberate change a test injects.
        # The module imports from the repository root (on PYTHONPATH).
        import importlib
        module, _, function = setup.partition(":")
        getattr(importlib.import_module(module), function)()
    if spec.get("collectives"):
        collectives.install()
    engine = dict(spec["engine"])
    k = spec["num_speculative_tokens"]
    if k:
        # Extra --speculative-config keys of this configuration (e.g. the
        # speculation watchdog's fallback_*); method and k are the spec's.
        engine["speculative_config"] = {
            **spec.get("speculative_config", {}), "method": spec["method"],
            "num_speculative_tokens": k
        }
    # As asked (vLLM fills the dict it is given with its configs).
    speculative = dict(engine.get("speculative_config") or {}) or None
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    start = time.perf_counter()
    llm = LLM(**engine, disable_log_stats=False)
    init_s = time.perf_counter() - start
    weights = llm.collective_rpc(_weights_bytes)[0]
    llm.collective_rpc(_install_forward_timers)
    draft_steps = install_draft_length_counter(llm)
    rss_after_load = peak_rss_bytes()
    emit("PROGRESS", {"event": "engine_ready", "init_s": init_s})
    batches = []
    for batch in spec["batch_sizes"]:
        result = run_batch(llm, spec, batch, draft_steps)
        batches.append(result)
        emit("PROGRESS", {"event": "batch_done", "batch_size": batch,
                          "decode_tokens_per_s":
                          result["decode_tokens_per_s"],
                          "acceptance": result.get("acceptance"),
                          "forward_time": result["forward_time"],
                          "draft_length": result.get("draft_length")})
    end = snapshot(llm)
    emit("RESULT", {
        "num_speculative_tokens": k,
        "speculative_config": speculative,
        "setup": setups(spec),
        "watchdog": None if not k else {
            "settings": _watchdog_settings(llm),
            "num_pauses": end.get(PAUSES),
            "paused": _paused(end)
        },
        "init_s": init_s,
        "torch_threads": torch.get_num_threads(),
        "memory": {"peak_rss_bytes": peak_rss_bytes(),
                   "peak_rss_after_load_bytes": rss_after_load,
                   "weights_bytes": weights["target"],
                   "drafter_weights_bytes": weights["drafter"],
                   "kv_cache_bytes_configured":
                   engine.get("kv_cache_memory_bytes")},
        "graphs": llm.collective_rpc(_graph_info)[0],
        "draft_shares": llm.collective_rpc(_draft_shares)[0],
        "batches": batches,
    })


if __name__ == "__main__":
    main(sys.argv[1])
