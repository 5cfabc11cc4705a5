"""Nightly regression: accuracy, acceptance, speed and memory against a
baseline, in one run.

    make nightly                                     # the fixture, ~10 min
    .venv/bin/python tools/nightly.py --baseline benchmarks/nightly/baseline.json \\
        --out benchmarks/nightly/runs [--model PATH] [--device cpu|npu]
    .venv/bin/python tools/nightly.py --smoke ...    # one config (CI)
    .venv/bin/python tools/nightly.py --device npu --preset original \\
        --model /home/glm4.5_w8a8_with_float_mtp ... # on an Ascend server

Measures, for the model (default: the fixture), in each graph mode: greedy
tokens with and without MTP against the offline reference (transformers +
the plain-torch MTP), MTP acceptance (rate and per position) against the
reference's, decode tokens/s at batch 1 and 16 as ratios measured in the
same run (MTP / no MTP, graph / eager), host time per step and the draft's
cost per target step, memory, and the invariants (the draft runs on the
target's embedding and LM head; graphs captured and replayed). Writes
``nightly-<time>.json`` into --out and the trend page ``trend.html`` over
every run there; exits 1 on any regression, printing what moved.
``--update-baseline`` rewrites the baseline's figures from this run (its
tolerances stay), on purpose only. See benchmarks/README.md.
"""

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchmark_mtp  # noqa: E402
from regress.check import compare, table  # noqa: E402
from regress.figures import collect  # noqa: E402
from regress.trend import write_trend  # noqa: E402

logger = logging.getLogger("nightly")
ROOT = Path(__file__).resolve().parent.parent
SCHEMA_VERSION = 1


@dataclasses.dataclass
class Plan:
    """What one nightly measures: k values per graph mode, batch sizes."""
    modes: dict[str, list[int]]
    batch_sizes: list[int]
    new_tokens: int
    repeats: int
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)


PLANS = {
    # Every graph mode with and without MTP k=1; k=1..3 in eager and in the
    # default mode (vLLM's FULL_AND_PIECEWISE).
    "full": Plan(modes={"eager": [1, 2, 3], "PIECEWISE": [1],
                        "FULL_DECODE_ONLY": [1],
                        "FULL_AND_PIECEWISE": [1, 2, 3]},
                 batch_sizes=[1, 16], new_tokens=32, repeats=3),
    # One config, for CI.
    "smoke": Plan(modes={"FULL_AND_PIECEWISE": [1]}, batch_sizes=[1, 16],
                  new_tokens=16, repeats=2),
}

# The original report's serve command, as far as one offline engine takes
# it: TP 8 with expert parallelism, its batch limits and capture sizes (its
# DP 2 runs as two such engines behind `vllm serve`; not here).
ORIGINAL_PRESET = {
    "tensor_parallel_size": 8, "enable_expert_parallel": True,
    "max_num_seqs": 32, "max_num_batched_tokens": 16384,
    "enable_prefix_caching": False, "seed": 1024,
    "gpu_memory_utilization": 0.9,
    "compilation_config": {"cudagraph_capture_sizes":
                           [1, 4, 8, 16, 32, 48, 64]},
}


def reference_results(model: Path, prompts: list[list[int]], ks: list[int],
                      new_tokens: int) -> dict[int, dict[str, Any]]:
    """The offline reference's greedy tokens and acceptance per k."""
    import torch
    from glm45ref import Glm45Reference, measure_acceptance
    torch.set_num_threads(1)
    ref = Glm45Reference(model)
    return {k: measure_acceptance(model, prompts, new_tokens, k,
                                  reference=ref) for k in ks}


def measure(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    out_logs = args.out / f"logs-{time.strftime('%Y%m%d-%H%M%S')}"
    runs = {}
    for mode, ks in plan.modes.items():
        logger.info("graph mode %s: no MTP and MTP k=%s", mode, ks)
        cfg = benchmark_mtp.BenchConfig(
            model=args.model, ks=ks, batch_sizes=plan.batch_sizes,
            new_tokens=plan.new_tokens, repeats=plan.repeats,
            device=args.device, graph_mode=mode, keep_outputs=True,
            setup=args.setup, engine_overrides=plan.engine)
        runs[mode] = benchmark_mtp.run_benchmark(cfg, out_logs / mode)
    reference = None
    if not args.skip_reference:
        logger.info("offline reference (transformers + plain-torch MTP)")
        prompts, _ = benchmark_mtp.load_prompts(benchmark_mtp.BenchConfig(
            model=args.model))
        ks = sorted({k for ks in plan.modes.values() for k in ks})
        # The prompts of the largest batch, whose outputs are compared.
        reference = reference_results(args.model,
                                      prompts[:max(plan.batch_sizes)], ks,
                                      plan.new_tokens)
    figures, details = collect(runs, reference,
                               accuracy_batch=max(plan.batch_sizes))
    for result in runs.values():
        for config in result["configs"]:
            for b in config["batches"]:
                b.pop("outputs", None)
    return {"schema_version": SCHEMA_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "settings": {"model": str(args.model), "device": args.device,
                         "plan": dataclasses.asdict(plan),
                         "reference": not args.skip_reference,
                         "setup": args.setup},
            "figures": figures, "details": details, "runs": runs}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, default=None,
                   help="default: benchmarks/nightly/baseline.json "
                   "(baseline-smoke.json with --smoke)")
    p.add_argument("--out", type=Path,
                   default=ROOT / "benchmarks" / "nightly" / "runs",
                   help="directory for the run's JSON and the trend page")
    p.add_argument("--model", type=Path, default=benchmark_mtp.DEFAULT_MODEL)
    p.add_argument("--device", choices=["cpu", "npu"], default="cpu",
                   help="npu: an Ascend server, or the torch_npu double "
                   "with VLLM_ASCEND_NPU_DOUBLE=1")
    p.add_argument("--smoke", action="store_true",
                   help="one config (default graph mode, k=1), for CI")
    p.add_argument("--preset", choices=["original"], default=None,
                   help="original: the report's parallel and graph flags "
                   "(TP 8, EP, capture sizes; needs 8 NPUs)")
    p.add_argument("--skip-reference", action="store_true",
                   help="no offline reference (a checkpoint too large for "
                   "transformers on the host); accuracy is then MTP vs no "
                   "MTP only")
    p.add_argument("--compare", type=Path, default=None,
                   help="check an earlier run's JSON instead of measuring")
    p.add_argument("--update-baseline", action="store_true",
                   help="write this run's figures into --baseline (its "
                   "tolerances stay)")
    p.add_argument("--setup", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    args = parse_args(argv)
    plan = PLANS["smoke" if args.smoke else "full"]
    if args.baseline is None:
        args.baseline = (ROOT / "benchmarks" / "nightly" /
                         ("baseline-smoke.json"
                          if args.smoke else "baseline.json"))
    if args.preset == "original":
        if args.device != "npu":
            raise SystemExit("nightly: --preset original needs --device npu "
                             "(8 NPUs for TP 8)")
        plan = dataclasses.replace(plan, engine=ORIGINAL_PRESET)
    if not args.baseline.is_file() and not args.update_baseline:
        raise SystemExit(f"nightly: no baseline {args.baseline}; write one "
                         "with --update-baseline")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.compare:
        result = json.loads(args.compare.read_text())
    else:
        try:
            result = measure(args, plan)
        except ValueError as e:
            raise SystemExit(f"nightly: {e}") from None
    baseline = (json.loads(args.baseline.read_text())
                if args.baseline.is_file() else {"tolerances": []})
    if args.update_baseline:
        baseline.update(created=result["created"],
                        settings=result["settings"],
                        figures=result["figures"])
        args.baseline.parent.mkdir(parents=True, exist_ok=True)
        args.baseline.write_text(json.dumps(baseline, indent=1) + "\n")
        logger.info("baseline %s rewritten from this run", args.baseline)
    rows = compare(result["figures"], baseline)
    result["regressions"] = [r.name for r in rows if r.regression]
    if not args.compare:
        path = args.out / f"nightly-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"run: {path}")
    print(table(rows))
    for tag, acc in result["details"].get("accuracy", {}).items():
        for prompt, where in acc["first_divergence"].items():
            print(f"accuracy {tag}: prompt {prompt} first differs at token "
                  f"{where['token']}: {where['got']} vs reference "
                  f"{where['want']}")
    print(f"trend: {write_trend(args.out, baseline)}")
    if result["regressions"]:
        print("nightly: REGRESSION in " + ", ".join(result["regressions"]))
        return 1
    print("nightly: no regression")
    return 0


if __name__ == "__main__":
    sys.exit(main())
