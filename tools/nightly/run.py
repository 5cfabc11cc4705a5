"""Nightly regression (``python -m tools.nightly``): accuracy, acceptance,
speed and memory against a baseline, in one run.

    make nightly                                     # the fixture, ~10 min
    .venv/bin/python -m tools.nightly \\
        --baseline benchmarks/nightly/baseline.json \\
        --out benchmarks/nightly/runs [--model PATH] [--device cpu|npu]
    .venv/bin/python -m tools.nightly --smoke ...   # one config (CI)
    .venv/bin/python -m tools.nightly --device npu --preset serve \\
        --model /home/glm4.5_w8a8_with_float_mtp --prompts prompts.json \\
        --baseline npu.json --update-baseline        # a new model's first run

Measures, for the model (default: the fixture), in each graph mode: greedy
tokens with and without MTP against the offline reference (transformers +
the plain-torch MTP), MTP acceptance (rate and per position) against the
reference's, decode tokens/s at batch 1 and 16 as ratios measured in the
same run (MTP / no MTP, graph / eager), host time per step and the draft's
cost per target step, memory, and the invariants (the draft runs on the
target's embedding and LM head; graphs captured and replayed); the full
plan adds the per-step device cost through the torch_npu double
(``cost.*``, tools.bench.step_cost). Writes
``nightly-<time>.json`` into --out and the trend page ``trend.html`` over
every run there; exits 1 on any regression, printing what moved, 2 when
it cannot measure.

The prompts are ``--prompts FILE``'s, else the model folder's
``heldout_prompts.json``; without either it refuses to run (acceptance on
random prompts means nothing). ``--update-baseline`` rewrites the
baseline's figures from this run, on purpose only; a new baseline (no file,
or one for another model) is checked with the default tolerances of
``tools.nightly.check.TOLERANCES``. See benchmarks/README.md.
"""

import argparse
import dataclasses
import hashlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Optional

from tools.bench import run as bench
from tools.nightly.check import TOLERANCES, compare, table
from tools.nightly.figures import collapsed, collect
from tools.nightly.trend import write_trend

logger = logging.getLogger("tools.nightly")
ROOT = Path(__file__).resolve().parents[2]
SCHEMA_VERSION = 1
COLLAPSED_SETUP = "tests.nightly.injections:collapsed_mtp_layer"
# Drafts per watchdog measurement in the collapsed run (vLLM's default of
# 256 is longer than the run).
COLLAPSED_WINDOW = 16


@dataclasses.dataclass
class Plan:
    """What one nightly measures: k values per graph mode, batch sizes."""
    modes: dict[str, list[int]]
    batch_sizes: list[int]
    new_tokens: int
    repeats: int
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Also a run with a collapsed MTP layer: the speculation watchdog must
    # pause within its window and keep tokens/s near no MTP.
    collapsed: bool = False


PLANS = {
    # Every graph mode with and without MTP k=1; k=1..3 in eager and in the
    # default mode (vLLM's FULL_AND_PIECEWISE).
    "full": Plan(modes={"eager": [1, 2, 3], "PIECEWISE": [1],
                        "FULL_DECODE_ONLY": [1],
                        "FULL_AND_PIECEWISE": [1, 2, 3]},
                 batch_sizes=[1, 16], new_tokens=32, repeats=3,
                 collapsed=True),
    # One config, for CI.
    "smoke": Plan(modes={"FULL_AND_PIECEWISE": [1]}, batch_sizes=[1, 16],
                  new_tokens=16, repeats=2),
}

# The reference serve command (DP 2 x TP 8 + EP, W8A8, graph capture
# sizes), as far as one offline engine takes it: TP 8 with expert
# parallelism, its batch limits and capture sizes (its DP 2 runs as two such
# engines behind `vllm serve`; not here). `--preset serve` selects it.
SERVE_PRESET = {
    "tensor_parallel_size": 8, "enable_expert_parallel": True,
    "max_num_seqs": 32, "max_num_batched_tokens": 16384,
    "enable_prefix_caching": False, "seed": 1024,
    "gpu_memory_utilization": 0.9,
    "compilation_config": {"cudagraph_capture_sizes":
                           [1, 4, 8, 16, 32, 48, 64]},
}


def on_device(plan: Plan, device: str) -> Plan:
    """The plan as the device runs it: the CPU reference device runs eager
    (no device graphs), so its graph modes are one eager mode with every
    k; graph modes need the NPU code paths (``--device npu``)."""
    if device != "cpu" or list(plan.modes) == ["eager"]:
        return plan
    ks = sorted({k for ks in plan.modes.values() for k in ks})
    return dataclasses.replace(plan, modes={"eager": ks})


class CannotRun(Exception):
    """The nightly cannot measure what it is asked to (exit status 2)."""


def _tokenize(model: Path, texts: list[str]) -> list[list[int]]:
    """Token ids of text prompts, as vLLM tokenizes a completion prompt."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    return [tokenizer.encode(text) for text in texts]


def load_prompts(model: Path,
                 path: Optional[Path]) -> tuple[list[list[int]], str]:
    """The prompts the nightly measures: ``path`` (``--prompts``), else the
    model's ``heldout_prompts.json``, as token ids, and where they came
    from. Each entry is a string, a list of token ids, or an object with
    ``token_ids`` (used as is) or ``text`` (the model's tokenizer's ids)."""
    source = path or model / bench.HELDOUT
    if not source.is_file():
        if path is not None:
            raise CannotRun(f"--prompts {path} does not exist")
        raise CannotRun(
            f"no prompts to measure acceptance on: {model} has no "
            f"{bench.HELDOUT} and no --prompts FILE was given "
            "(a JSON list of strings); refusing to measure on random prompts")
    bad = CannotRun(
        f"{source}: expected a non-empty JSON list of strings, of token id "
        "lists, or of objects with 'token_ids' or 'text'")
    try:
        data = json.loads(source.read_text())
    except json.JSONDecodeError as e:
        raise CannotRun(f"{source}: not JSON ({e})") from None
    if not isinstance(data, list) or not data:
        raise bad
    prompts: list[Any] = []
    texts: dict[int, str] = {}
    for i, entry in enumerate(data):
        if isinstance(entry, dict):
            entry = entry.get("token_ids", entry.get("text"))
        if isinstance(entry, str) and entry:
            texts[i] = entry
        elif not (isinstance(entry, list) and entry and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in entry)):
            raise bad
        prompts.append(entry)
    if texts:
        for i, ids in zip(texts, _tokenize(model, list(texts.values()))):
            prompts[i] = ids
    return prompts, str(source)


def _digest(prompts: list[list[int]]) -> str:
    return hashlib.sha1(json.dumps(prompts).encode()).hexdigest()


def plan_name(settings: dict[str, Any]) -> Optional[str]:
    """Which of PLANS a run's or baseline's settings were measured with."""
    if settings.get("plan_name") in PLANS:
        return settings["plan_name"]
    plan = {**settings.get("plan", {}), "engine": {}}
    return next((name for name, p in PLANS.items()
                 if {**dataclasses.asdict(p), "engine": {}} == plan), None)


def reference_results(model: Path, prompts: list[list[int]], ks: list[int],
                      new_tokens: int) -> dict[int, dict[str, Any]]:
    """The offline reference's greedy tokens and acceptance per k."""
    import torch

    from tools.reference import Glm45Reference, measure_acceptance
    torch.set_num_threads(1)
    ref = Glm45Reference(model)
    return {k: measure_acceptance(model, prompts, new_tokens, k,
                                  reference=ref) for k in ks}


def step_cost_figures(out: Path) -> dict[str, float]:
    """The per-step cost figures (``cost.*``: kernels per layer and step,
    syncs per step, MoE bytes per token, int8 weights in NZ, host time
    MTP / no MTP) of this tree, through the torch_npu double."""
    from tools.bench import step_cost
    if not step_cost.double_installed():
        raise CannotRun("the step cost needs the torch_npu double "
                        "(make install); --skip-step-cost to go without")
    logger.info("per-step cost through the double (tools.bench.step_cost)")
    result = step_cost.run(step_cost.parse_args(
        ["--against", "", "--out", str(out)]), emit=logger.info)
    return result["columns"]["this"]["figures"]


def measure(args: argparse.Namespace, plan: Plan,
            prompts: list[list[int]], source: str) -> dict[str, Any]:
    out_logs = args.out / f"logs-{time.strftime('%Y%m%d-%H%M%S')}"
    out_logs.mkdir(parents=True, exist_ok=True)
    # tools.bench.run takes token id lists from a file.
    prompts_file = out_logs / "prompts.json"
    prompts_file.write_text(json.dumps(prompts) + "\n")
    logger.info("%d prompts from %s", len(prompts), source)
    runs = {}
    for mode, ks in plan.modes.items():
        logger.info("graph mode %s: no MTP and MTP k=%s", mode, ks)
        cfg = bench.BenchConfig(
            model=args.model, ks=ks, batch_sizes=plan.batch_sizes,
            new_tokens=plan.new_tokens, repeats=plan.repeats,
            device=args.device, graph_mode=mode, keep_outputs=True,
            setup=args.setup, engine_overrides=plan.engine,
            prompts_file=prompts_file)
        runs[mode] = bench.run_benchmark(cfg, out_logs / mode)
    reference = None
    if not args.skip_reference:
        logger.info("offline reference (transformers + plain-torch MTP)")
        ks = sorted({k for ks in plan.modes.values() for k in ks})
        # The prompts of the largest batch, whose outputs are compared.
        reference = reference_results(args.model,
                                      prompts[:max(plan.batch_sizes)], ks,
                                      plan.new_tokens)
    figures, details = collect(runs, reference,
                               accuracy_batch=max(plan.batch_sizes))
    if plan.collapsed:
        logger.info("collapsed MTP layer: no MTP and MTP k=1 with the "
                    "speculation watchdog (window %d)", COLLAPSED_WINDOW)
        cfg = bench.BenchConfig(
            model=args.model, ks=[1], batch_sizes=plan.batch_sizes,
            new_tokens=plan.new_tokens, repeats=plan.repeats,
            device=args.device, keep_outputs=False, setup=args.setup,
            engine_overrides=plan.engine, prompts_file=prompts_file)
        runs["collapsed"] = bench.run_benchmark(
            cfg, out_logs / "collapsed", variants=[
                bench.Variant(0),
                bench.Variant(1, speculative={
                    "fallback_window": COLLAPSED_WINDOW},
                              setup=COLLAPSED_SETUP)])
        figures.update(collapsed(runs["collapsed"]))
    if not args.smoke and not args.skip_step_cost:
        figures.update(step_cost_figures(out_logs / "step-cost.json"))
    for result in runs.values():
        for config in result["configs"]:
            for b in config["batches"]:
                b.pop("outputs", None)
    return {"schema_version": SCHEMA_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "settings": {"model": str(args.model), "device": args.device,
                         "plan_name": "smoke" if args.smoke else "full",
                         "plan": dataclasses.asdict(plan),
                         "prompts": {"source": source, "count": len(prompts),
                                     "sha1": _digest(prompts)},
                         "reference": not args.skip_reference,
                         "setup": args.setup},
            "figures": figures, "details": details, "runs": runs}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tools.nightly", description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, default=None,
                   help="default: benchmarks/nightly/baseline.json "
                   "(baseline-smoke.json with --smoke)")
    p.add_argument("--out", type=Path,
                   default=ROOT / "benchmarks" / "nightly" / "runs",
                   help="directory for the run's JSON and the trend page")
    p.add_argument("--model", type=Path, default=bench.DEFAULT_MODEL)
    p.add_argument("--prompts", type=Path, default=None,
                   help="JSON list of prompts (strings, token id lists, or "
                   "heldout_prompts.json's objects); default: the model's "
                   "heldout_prompts.json")
    p.add_argument("--device", choices=["cpu", "npu"], default="cpu",
                   help="npu: an Ascend server, or the torch_npu double "
                   "with VLLM_ASCEND_NPU_DOUBLE=1")
    p.add_argument("--smoke", action="store_true",
                   help="one config (k=1; eager on the CPU), for CI")
    p.add_argument("--preset", choices=["serve"], default=None,
                   help="serve: the reference serve command's parallel "
                   "and graph flags "
                   "(TP 8, EP, capture sizes; needs 8 NPUs)")
    p.add_argument("--skip-reference", action="store_true",
                   help="no offline reference (a checkpoint too large for "
                   "transformers on the host); accuracy is then MTP vs no "
                   "MTP only")
    p.add_argument("--skip-step-cost", action="store_true",
                   help="no per-step cost report (tools.bench.step_cost, "
                   "through the torch_npu double; the full plan runs it)")
    p.add_argument("--compare", type=Path, default=None,
                   help="check an earlier run's JSON instead of measuring")
    p.add_argument("--update-baseline", action="store_true",
                   help="write this run's figures into --baseline (its "
                   "tolerances stay; a new baseline, or one for another "
                   "model, gets the default tolerances)")
    p.add_argument("--setup", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _same_model(a: Optional[str], b: Optional[str]) -> bool:
    return a is not None and b is not None and (
        Path(a).resolve() == Path(b).resolve())


def update_baseline(path: Path, result: dict[str, Any]) -> dict[str, Any]:
    """The baseline with this run's figures. One for the same model keeps
    its note and its own tolerances; a new one (no file, or another model)
    has none: the default tolerances of its plan apply."""
    old = json.loads(path.read_text()) if path.is_file() else None
    model = result["settings"].get("model")
    if old is not None and _same_model(old.get("settings", {}).get("model"),
                                       model):
        baseline = old
        logger.info("baseline %s rewritten from this run", path)
    else:
        baseline = {"note": "Written by python -m tools.nightly "
                    f"--update-baseline for {model}. Tolerances: the "
                    "defaults of tools/nightly/check.py (TOLERANCES) for "
                    "its plan; a 'tolerances' list here would be checked "
                    "first."}
        logger.info("new baseline %s for %s (%s), default tolerances", path,
                    model, "replacing one for " +
                    str(old.get("settings", {}).get("model"))
                    if old is not None else "no earlier file")
    baseline.update(created=result["created"], settings=result["settings"],
                    figures=result["figures"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(baseline, indent=1) + "\n")
    return baseline


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    args = parse_args(argv)
    try:
        return run(args)
    except (CannotRun, ValueError) as e:
        print(f"nightly: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    plan = on_device(PLANS["smoke" if args.smoke else "full"], args.device)
    if args.baseline is None:
        args.baseline = (ROOT / "benchmarks" / "nightly" /
                         ("baseline-smoke.json"
                          if args.smoke else "baseline.json"))
    if args.preset == "serve":
        if args.device != "npu":
            raise CannotRun("--preset serve needs --device npu (8 NPUs "
                            "for TP 8)")
        plan = dataclasses.replace(plan, engine=SERVE_PRESET)
    if not args.baseline.is_file() and not args.update_baseline:
        raise CannotRun(f"no baseline {args.baseline}; write one with "
                        "--update-baseline")
    if args.compare:
        result = json.loads(args.compare.read_text())
    else:
        bench.BenchConfig(model=args.model).validate()
        prompts, source = load_prompts(args.model, args.prompts)
        args.out.mkdir(parents=True, exist_ok=True)
        result = measure(args, plan, prompts, source)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.update_baseline:
        baseline = update_baseline(args.baseline, result)
    else:
        baseline = json.loads(args.baseline.read_text())
    defaults = TOLERANCES[plan_name(baseline.get("settings", {}))
                          or plan_name(result["settings"])
                          or ("smoke" if args.smoke else "full")]
    rows = compare(result["figures"], baseline, defaults)
    result["regressions"] = [r.name for r in rows if r.regression]
    if not args.compare:
        path = args.out / f"nightly-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"run: {path}")
    was = baseline.get("settings", {}).get("prompts", {})
    now = result["settings"].get("prompts", {})
    if was.get("sha1") and now.get("sha1") and was["sha1"] != now["sha1"]:
        print(f"nightly: note: the baseline was measured on other prompts "
              f"({was.get('source')}, {was.get('count')}) than this run "
              f"({now.get('source')}, {now.get('count')})")
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
