"""Decode throughput in each graph mode, with and without MTP, in one run.

    .venv/bin/python -m tools.bench.graph_modes           # about 8 min
    .venv/bin/python -m tools.bench.graph_modes \
        --modes eager,FULL_DECODE_ONLY --k 1,2

For each mode (``eager`` is ``--enforce-eager``; the others are vLLM's
``cudagraph_mode`` values), ``tools.bench.run``'s measurement (no MTP
and MTP with each ``--k``, fresh engine processes, median decode tokens/s of
paired runs) with that mode, then one table: tokens/s, the MTP/no-MTP and
graph/eager ratios side by side, acceptance, whether the greedy tokens equal
eager's, host time per step outside the model forwards; and per engine the
graphs captured, the capture time and the graph pool.

Graphs are the NPU's: ``--device npu`` (the default) on an Ascend NPU, or
off one through the torch_npu double (``VLLM_ASCEND_NPU_DOUBLE=1``, with a
checkpoint the NPU kernels take: bfloat16, head_dim 128 or 192), where the
double's graphs replay recorded ops from Python: what carries over to an NPU
is the structure (which steps replay graphs, how many graphs, the host time
left outside them), not the ratio. The CPU reference device runs eager.
"""

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Optional

from tools.bench import run as bench
from tools.bench.report import MiB, config_name, fmt, grid

logger = logging.getLogger("tools.bench.graph_modes")
MODES = ["eager", "PIECEWISE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


def run(cfg: bench.BenchConfig, modes: list[str],
        log_dir: Path) -> dict[str, Any]:
    runs = {}
    for mode in modes:
        logger.info("graph mode %s", mode)
        runs[mode] = bench.run_benchmark(
            dataclasses.replace(cfg, graph_mode=mode), log_dir / mode)
    return {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "settings": {"modes": modes, "k": cfg.ks,
                         "batch_sizes": cfg.batch_sizes,
                         "new_tokens": cfg.new_tokens,
                         "repeats": cfg.repeats, "device": cfg.device},
            "modes": runs, "rows": rows(runs)}


def _configs(result: dict) -> dict[str, dict]:
    return {c["name"]: c for c in result["configs"]}


def rows(runs: dict[str, dict]) -> list[dict[str, Any]]:
    """One row per (mode, config, batch): tokens/s and its ratios."""
    eager = _configs(runs["eager"]) if "eager" in runs else None
    out = []
    for mode, result in runs.items():
        configs = _configs(result)
        for name, cfg in configs.items():
            for b in cfg["batches"]:
                batch = b["batch_size"]
                no_mtp = find_batch(configs.get(config_name(0)), batch)
                ref = find_batch(eager.get(name), batch) if eager else None
                fwd = b.get("forward_time") or {}
                out.append({
                    "mode": mode, "config": name, "batch_size": batch,
                    "tokens_per_s": b["decode_tokens_per_s"],
                    "mtp_over_no_mtp": (b["decode_tokens_per_s"] /
                                        no_mtp["decode_tokens_per_s"]
                                        if name != config_name(0) and no_mtp
                                        else None),
                    "graph_over_eager": (b["decode_tokens_per_s"] /
                                         ref["decode_tokens_per_s"]
                                         if ref and mode != "eager" else None),
                    "same_as_eager": (b["outputs_sha1"] == ref["outputs_sha1"]
                                      if ref else None),
                    "acceptance_rate": (b.get("acceptance") or {}).get(
                        "acceptance_rate"),
                    "host_ms_per_step": b.get("host_ms_per_step"),
                    "draft_over_target": fwd.get("draft_over_target"),
                })
    return out


def find_batch(cfg: Optional[dict], batch: int) -> Optional[dict]:
    """The batch of size ``batch`` in a configuration's result, if any."""
    if cfg is None:
        return None
    return next((b for b in cfg["batches"] if b["batch_size"] == batch),
                None)


def format_tables(results: dict[str, Any]) -> str:
    header = ["mode", "config", "batch", "tok/s", "MTP/no-MTP",
              "graph/eager", "acc", "same as eager", "host ms/step",
              "draft/target"]
    body = [[r["mode"], r["config"], str(r["batch_size"]),
             fmt(r["tokens_per_s"], ".1f"), fmt(r["mtp_over_no_mtp"]),
             fmt(r["graph_over_eager"]),
             fmt(r["acceptance_rate"], ".1%"),
             "-" if r["same_as_eager"] is None else
             ("yes" if r["same_as_eager"] else "NO"),
             fmt(r["host_ms_per_step"]), fmt(r["draft_over_target"])]
            for r in results["rows"]]
    graphs = [["mode", "config", "graphs captured", "capture s",
               "graph pool MiB", "peak RSS MiB"]]
    for mode, result in results["modes"].items():
        for c in result["configs"]:
            g = c.get("graphs") or {}
            graphs.append([mode, c["name"], str(g.get("captured", 0)),
                           fmt(g.get("capture_s")),
                           fmt((g.get("pool_bytes") or 0) / MiB),
                           f"{c['memory']['peak_rss_bytes'] / MiB:.0f}"])
    return grid(header, body) + "\n\n" + grid(graphs[0], graphs[1:])


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, from {MODES}")
    p.add_argument("--k", type=bench.int_list, default=[1])
    p.add_argument("--batch-sizes", type=bench.int_list,
                   default=[1, 4, 16])
    p.add_argument("--new-tokens", "-n", type=int, default=32)
    p.add_argument("--repeats", "-r", type=int, default=3)
    p.add_argument("--model", type=Path, default=bench.DEFAULT_MODEL)
    p.add_argument("--device", default="npu", choices=["cpu", "npu", "auto"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"tools.bench.graph_modes: unknown mode(s) {unknown}; "
                         f"use {MODES}")
    if args.device == "cpu" and modes != ["eager"]:
        raise SystemExit("tools.bench.graph_modes: the CPU reference device "
                         "runs eager; graph modes need --device npu (on an "
                         "NPU, or through the torch_npu double with "
                         "VLLM_ASCEND_NPU_DOUBLE=1)")
    cfg = bench.BenchConfig(model=args.model, ks=args.k,
                                    batch_sizes=args.batch_sizes,
                                    new_tokens=args.new_tokens,
                                    repeats=args.repeats, device=args.device)
    out = args.out or (bench.ROOT / "benchmarks" / "results" /
                       f"graph-modes-{time.strftime('%Y%m%d-%H%M%S')}.json")
    results = run(cfg, modes, out.with_suffix(".logs"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(format_tables(results))
    print(f"JSON: {out}")
    if any(r["same_as_eager"] is False for r in results["rows"]):
        raise SystemExit("tools.bench.graph_modes: a graph mode changed the "
                         "greedy tokens")
    return results


if __name__ == "__main__":
    main()
