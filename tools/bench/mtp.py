"""Decode throughput of GLM-4.5 with and without MTP, acceptance, memory.

    .venv/bin/python -m tools.bench.mtp                   # fixture, k=1
    .venv/bin/python -m tools.bench.mtp --k 1,2 --batch-sizes 1,4
    .venv/bin/python -m tools.bench.mtp --baseline        # = --k "" \
        --batch-sizes 1,8: the plugin's no-MTP baseline
    .venv/bin/python -m tools.bench.mtp --watchdog        # k=1 off vs on
    .venv/bin/python -m tools.bench.mtp --collapsed       # and a collapsed
        MTP layer: speculation watchdog off vs on vs no MTP
    .venv/bin/python -m tools.bench.mtp --k 1,2,3 --adaptive  # adaptive
        draft length vs no MTP and each fixed k

Each engine configuration (no MTP, then MTP with each ``--k``) runs in a
fresh process (``tools/bench/engine_child.py``) that, per batch size, makes
a warm-up run, then ``--repeats`` pairs of timed greedy runs (temperature 0,
ignore_eos) over the same prompts: one with ``max_tokens=1`` (prefill and
first token) and one with ``max_tokens=N``. Decode tokens/s of a pair is
``B * (N - 1) / (T_N - T_1)``; the median over the pairs is reported. The
greedy outputs with MTP must equal those without; the table says so.
Writes ``--out`` (JSON) and a PNG next to it. See benchmarks/README.md.

``--watchdog`` runs each k twice: with vLLM's speculation watchdog off
(``fallback_acceptance_floor: 0``: a draft at every step) and on
(``k=K+wd``: vLLM's settings, but a window of ``--fallback-window``
drafts, 32 by default, since these runs are short); ``--collapsed`` adds
both again with the MTP layer collapsed (``COLLAPSED``, called in the MTP
engines only). The table puts every ratio over no MTP side by side, with
the watchdog's pauses. Without these flags nothing changes: each k runs
with the engine's own speculative config (the watchdog on at vLLM's
defaults), which never pauses a healthy draft; the table says so if it
did.

``--adaptive`` adds ``adaptive``: MTP with k = max(--k) and vLLM's
``adaptive_draft_length: true`` (each step the scheduler picks a draft
length 0..k; the watchdog at vLLM's defaults), and with ``--collapsed``
``adaptive_collapsed`` (the same with the MTP layer collapsed); the fixed
k's are the default run's (``mtp_k<k>``, watchdog at vLLM's defaults)
unless ``--watchdog``, ``--fallback-window`` or ``--watchdog-config`` ask
for the watchdog comparison's. The same side-by-side table, then per batch
size each adaptive config's tokens/s over the best of no MTP and every
fixed k on the same layer ("adaptive / best"; the goal is >= 0.95).
"""

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Optional

from tools.bench.report import (adaptive_vs_best, format_table, write_json,
                                write_plot)
from tools.bench.run import (HELDOUT, TIMING_METHOD, BenchConfig, Variant,
                             default_out, int_list, run_benchmark)

# The setup that collapses the MTP layer's acceptance (--collapsed).
COLLAPSED = "tests.nightly.injections:collapsed_mtp_layer"
# --fallback-window's default, and vLLM's (SpeculativeConfig.
# fallback_window; the parent does not import vLLM).
FALLBACK_WINDOW = 32
VLLM_FALLBACK_WINDOW = 256
WATCHDOG_OFF = {"fallback_acceptance_floor": 0}
# --adaptive's --speculative-config key (vLLM patch 0013).
ADAPTIVE = {"adaptive_draft_length": True}
# What --adaptive aims at: its tokens/s over the best fixed config's.
ADAPTIVE_GOAL = 0.95


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = BenchConfig()
    p.add_argument("--model", type=Path, default=d.model,
                   help="checkpoint directory (default: the tiny fixture)")
    p.add_argument("--k", type=int_list, default=d.ks,
                   help="MTP draft lengths, comma-separated ('' for none); "
                   "no MTP always runs (default: 1)")
    p.add_argument("--batch-sizes", type=int_list, default=d.batch_sizes,
                   help="default: 1,4,16")
    p.add_argument("--new-tokens", "-n", type=int, default=d.new_tokens,
                   help=f"new tokens per request (default {d.new_tokens})")
    p.add_argument("--repeats", "-r", type=int, default=d.repeats)
    p.add_argument("--warmup-tokens", type=int, default=d.warmup_tokens)
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--kv-cache-bytes", type=int, default=d.kv_cache_bytes)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: longest prompt + N + k, rounded up to 64")
    p.add_argument("--method", default=d.method)
    p.add_argument("--device", default=os.environ.get(
        "VLLM_ASCEND_DEVICE", d.device), choices=["cpu", "npu", "auto"],
                   help="VLLM_ASCEND_DEVICE for the engines (default cpu)")
    p.add_argument("--prompts", type=Path, default=None,
                   help="JSON list of token id lists (default: the model's "
                   f"{HELDOUT})")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch threads per engine (default 1; 0 keeps "
                   "torch's default)")
    p.add_argument("--timeout", type=int, default=d.timeout_s,
                   help="seconds per engine configuration")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default benchmarks/results/<time>.json);"
                   " the PNG and engine logs go next to it")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--baseline", action="store_true",
                   help="the plugin's no-MTP baseline: no MTP at batch 1 "
                   "and 8 (same as --k '' --batch-sizes 1,8)")
    wd = p.add_argument_group(
        "speculation watchdog", "compare each k with vLLM's speculation "
        "watchdog off and on (benchmarks/README.md)")
    wd.add_argument("--watchdog", action="store_true",
                    help="run each k with the watchdog off "
                    "(fallback_acceptance_floor 0) and on (k=K+wd)")
    wd.add_argument("--collapsed", action="store_true",
                    help="also both with the MTP layer collapsed "
                    f"({COLLAPSED}) in the MTP engines; implies --watchdog")
    wd.add_argument("--fallback-window", type=int, default=None,
                    metavar="N",
                    help="fallback_window of the k=K+wd configs (default "
                    f"{FALLBACK_WINDOW}; vLLM's is {VLLM_FALLBACK_WINDOW}, "
                    "longer than these runs); implies --watchdog")
    wd.add_argument("--watchdog-config", type=json_object, default=None,
                    metavar="JSON",
                    help="more --speculative-config keys for the k=K+wd "
                    "configs, e.g. '{\"fallback_probe_interval\": 64}'; "
                    "implies --watchdog")
    ad = p.add_argument_group(
        "adaptive draft length", "compare vLLM's adaptive_draft_length "
        "with no MTP and each fixed k (benchmarks/README.md)")
    ad.add_argument("--adaptive", action="store_true",
                    help="add 'adaptive': k = max(--k) with "
                    "adaptive_draft_length true (and 'adaptive collapsed' "
                    "with --collapsed, which then adds no watchdog configs "
                    "unless --watchdog is given)")
    return p.parse_args(argv)


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got "
                                         f"{text!r}")
    return value


def watchdog_requested(args: argparse.Namespace) -> bool:
    """Whether the run is a watchdog comparison (fixed k with the watchdog
    off and on). ``--collapsed`` implies one, except with ``--adaptive``,
    where it adds the collapsed adaptive config only."""
    return bool(args.watchdog
                or (args.collapsed and not args.adaptive)
                or args.fallback_window is not None
                or args.watchdog_config is not None)


def variants_from_args(
        args: argparse.Namespace,
        cfg: BenchConfig) -> tuple[Optional[list[Variant]], dict[str, Any]]:
    """The engine configurations of a watchdog comparison and/or of an
    adaptive draft length's, and their description for the report (the
    results' ``watchdog`` and ``adaptive`` keys); (None, {}) without
    either (the default configurations: no MTP, then each k)."""
    adaptive = args.adaptive
    if not watchdog_requested(args):
        if not adaptive:
            return None, {}
        if not cfg.ks:
            raise ValueError("--adaptive needs at least one --k")
        variants = [Variant(k) for k in [0] + sorted(set(cfg.ks))]
        return _with_adaptive(args, cfg, variants, {})
    if not cfg.ks:
        raise ValueError("--watchdog and --collapsed need at least one --k")
    window = (FALLBACK_WINDOW
              if args.fallback_window is None else args.fallback_window)
    if window < 1:
        raise ValueError(f"--fallback-window must be >= 1, got {window}")
    extra = dict(args.watchdog_config or {})
    if "fallback_window" in extra:
        raise ValueError("give the window with --fallback-window, not in "
                         "--watchdog-config")
    if extra.get("fallback_acceptance_floor") == 0:
        raise ValueError("--watchdog-config: fallback_acceptance_floor 0 "
                         "turns the k=K+wd configs' watchdog off")
    on = {**extra, "fallback_window": window}
    layers = [("", None)] + ([("_collapsed", COLLAPSED)]
                             if args.collapsed else [])
    variants = [Variant(0)]
    for suffix, setup in layers:
        for k in sorted(set(cfg.ks)):
            variants += [
                Variant(k, f"mtp_k{k}{suffix}", dict(WATCHDOG_OFF), setup),
                Variant(k, f"mtp_k{k}+wd{suffix}", dict(on), setup),
            ]
    info = {"fallback_window": window,
            "default_window": VLLM_FALLBACK_WINDOW, "extra": extra,
            "collapsed": COLLAPSED if args.collapsed else None}
    if adaptive:
        return _with_adaptive(args, cfg, variants, {"watchdog": info})
    return variants, {"watchdog": info}


def _with_adaptive(args: argparse.Namespace, cfg: BenchConfig,
                   variants: list[Variant],
                   info: dict[str, Any]) -> tuple[list[Variant], dict]:
    """``variants`` (no MTP and fixed k's) followed by ``adaptive`` (and
    ``adaptive_collapsed`` with --collapsed), each compared with no MTP and
    the fixed k's of its layer (same setup)."""
    k = max(cfg.ks)
    layers = [("adaptive", None)] + ([("adaptive_collapsed", COLLAPSED)]
                                     if args.collapsed else [])
    configs = {name: {"setup": setup,
                      "best_of": [v.name for v in variants
                                  if not v.k or v.setup == setup]}
               for name, setup in layers}
    variants = variants + [Variant(k, name, dict(ADAPTIVE), setup)
                           for name, setup in layers]
    return variants, {**info, "adaptive": {
        "k": k, "speculative_config": dict(ADAPTIVE), "goal": ADAPTIVE_GOAL,
        "collapsed": COLLAPSED if args.collapsed else None,
        "configs": configs}}


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    ks, batches = args.k, args.batch_sizes
    if args.baseline:
        ks, batches = [], [1, 8]
    return BenchConfig(model=args.model, ks=ks, batch_sizes=batches,
                       new_tokens=args.new_tokens, repeats=args.repeats,
                       warmup_tokens=args.warmup_tokens, dtype=args.dtype,
                       kv_cache_bytes=args.kv_cache_bytes,
                       max_model_len=args.max_model_len, method=args.method,
                       device=args.device, prompts_file=args.prompts,
                       timeout_s=args.timeout, threads=args.threads)


def main(argv: Optional[list[str]] = None,
         emit: Callable[[str], None] = print) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    args = parse_args(argv)
    cfg = config_from_args(args)
    out = args.out or default_out()
    try:
        variants, info = variants_from_args(args, cfg)
        results = run_benchmark(cfg, out.with_suffix(".logs"), variants)
    except ValueError as e:
        raise SystemExit(f"tools.bench.mtp: {e}") from None
    results.update(info)
    if "adaptive" in results:
        results["adaptive"]["vs_best"] = adaptive_vs_best(results)
    write_json(results, out)
    emit(format_table(results))
    emit(f"timing: {TIMING_METHOD}")
    emit(f"JSON: {out}")
    if not args.no_plot:
        png = out.with_suffix(".png")
        write_plot(results, png)
        emit(f"plot: {png}")
    if results["outputs_identical"] is False:
        raise SystemExit("tools.bench.mtp: greedy outputs with MTP differ from "
                         "those without; the speedups are not valid")
    return results


if __name__ == "__main__":
    main()
