"""Float vs Ascend W8A8 (``--quantization ascend``), with and without MTP,
in one run.

    .venv/bin/python -m tools.bench.quantization          # ~6 min
    .venv/bin/python -m tools.bench.quantization --k 1,2 --batch-sizes 1,8
    .venv/bin/python -m tools.bench.quantization --model SRC --w8a8 DST

The W8A8 checkpoint is ``--w8a8``, or is written from ``--model`` by
``python -m tools.quantize.w8a8 --float-mtp`` (W8A8 with a float MTP
layer, as in the reference serve command) into a temporary folder. For
each precision, ``tools.bench.run``'s measurement (no MTP and MTP with
each ``--k``, fresh engine processes, median decode tokens/s of paired
runs); then one table with the W8A8/float and MTP/no-MTP ratios side by
side, the acceptance of each, and one with the weights and peak memory. On
the CPU reference device the W8A8 kernels are exact integer references (int8
inputs, int32 accumulation in Python-level torch ops), so W8A8 is slower
there than float: what carries over to an NPU is the memory and the
acceptance, not the CPU speed ratio.
"""

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from tools.bench import run as bench
from tools.bench.report import MiB, fmt, grid

logger = logging.getLogger("tools.bench.quantization")
QUANTIZE = "tools.quantize.w8a8"


def quantize(model: Path, out: Path) -> None:
    logger.info("writing the W8A8 (float MTP) checkpoint of %s to %s", model,
                out)
    subprocess.run([
        sys.executable, "-m", QUANTIZE, "--model",
        str(model), "--out",
        str(out), "--float-mtp"
    ],
                   check=True,
                   env=bench.child_env(dict(os.environ)))


def run(cfg: bench.BenchConfig, w8a8: Path,
        log_dir: Path) -> dict[str, Any]:
    runs = {}
    for precision, model, overrides in (
        ("float", cfg.model, {}),
        ("w8a8", w8a8, {"quantization": "ascend"}),
    ):
        logger.info("precision %s: %s", precision, model)
        runs[precision] = bench.run_benchmark(
            dataclasses.replace(cfg,
                                model=model,
                                engine_overrides={
                                    **cfg.engine_overrides,
                                    **overrides
                                }), log_dir / precision)
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {
            "model": str(cfg.model),
            "w8a8": str(w8a8),
            "k": cfg.ks,
            "batch_sizes": cfg.batch_sizes,
            "new_tokens": cfg.new_tokens,
            "repeats": cfg.repeats,
            "dtype": cfg.dtype,
            "device": cfg.device
        },
        "precisions": runs,
        "rows": rows(runs),
        "memory": memory_rows(runs),
    }


def _batches(result: dict) -> dict[tuple[str, int], dict]:
    return {(c["name"], b["batch_size"]): b
            for c in result["configs"] for b in c["batches"]}


def _identical(result: dict, name: str, batch: int) -> Optional[bool]:
    for r in result["comparison"]:
        if r["config"] == name and r["batch_size"] == batch:
            return r["outputs_identical"]
    return None


def _ratio(a: Optional[dict], b: Optional[dict]) -> Optional[float]:
    if not a or not b:
        return None
    return a["decode_tokens_per_s"] / b["decode_tokens_per_s"]


def rows(runs: dict[str, dict]) -> list[dict[str, Any]]:
    """One row per (config, batch): both precisions' tokens/s and ratios."""
    flt, w8 = _batches(runs["float"]), _batches(runs["w8a8"])
    no_mtp = runs["float"]["configs"][0]["name"]
    out = []
    for (name, batch), f in flt.items():
        w = w8.get((name, batch))
        acc = {
            p: ((b or {}).get("acceptance") or {}).get("acceptance_rate")
            for p, b in (("float", f), ("w8a8", w))
        }
        out.append({
            "config": name,
            "batch_size": batch,
            "float_tokens_per_s": f["decode_tokens_per_s"],
            "w8a8_tokens_per_s": w and w["decode_tokens_per_s"],
            "w8a8_over_float": _ratio(w, f),
            "float_mtp_over_no_mtp": (_ratio(f, flt.get((no_mtp, batch)))
                                      if name != no_mtp else None),
            "w8a8_mtp_over_no_mtp": (_ratio(w, w8.get((no_mtp, batch)))
                                     if name != no_mtp else None),
            "float_acceptance_rate": acc["float"],
            "w8a8_acceptance_rate": acc["w8a8"],
            "float_same_as_no_mtp": _identical(runs["float"], name, batch),
            "w8a8_same_as_no_mtp": _identical(runs["w8a8"], name, batch),
        })
    return out


def memory_rows(runs: dict[str, dict]) -> list[dict[str, Any]]:
    flt = {c["name"]: c["memory"] for c in runs["float"]["configs"]}
    out = []
    for precision, result in runs.items():
        for c in result["configs"]:
            mem = c["memory"]
            ref = flt.get(c["name"])
            out.append({
                "precision": precision,
                "config": c["name"],
                "weights_bytes": mem["weights_bytes"],
                "drafter_weights_bytes": mem["drafter_weights_bytes"],
                "weights_over_float": (mem["weights_bytes"] /
                                       ref["weights_bytes"] if ref else None),
                "peak_rss_bytes": mem["peak_rss_bytes"],
            })
    return out


def _same(value: Optional[bool]) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def format_tables(results: dict[str, Any]) -> str:
    header = [
        "config", "batch", "float tok/s", "W8A8 tok/s", "W8A8/float",
        "MTP/no-MTP float", "MTP/no-MTP W8A8", "acc float", "acc W8A8",
        "same as no-MTP (float, W8A8)"
    ]
    body = [[
        r["config"],
        str(r["batch_size"]),
        fmt(r["float_tokens_per_s"], ".1f"),
        fmt(r["w8a8_tokens_per_s"], ".1f"),
        fmt(r["w8a8_over_float"]),
        fmt(r["float_mtp_over_no_mtp"]),
        fmt(r["w8a8_mtp_over_no_mtp"]),
        fmt(r["float_acceptance_rate"], ".1%"),
        fmt(r["w8a8_acceptance_rate"], ".1%"),
        f"{_same(r['float_same_as_no_mtp'])}, "
        f"{_same(r['w8a8_same_as_no_mtp'])}",
    ] for r in results["rows"]]
    mem_header = [
        "precision", "config", "weights MiB", "drafter MiB", "weights/float",
        "peak RSS MiB"
    ]
    mem = [[
        r["precision"], r["config"], f"{r['weights_bytes'] / MiB:.2f}",
        f"{r['drafter_weights_bytes'] / MiB:.2f}",
        fmt(r["weights_over_float"]), f"{r['peak_rss_bytes'] / MiB:.0f}"
    ] for r in results["memory"]]
    return grid(header, body) + "\n\n" + grid(mem_header, mem)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=bench.DEFAULT_MODEL,
                   help="the float checkpoint")
    p.add_argument("--w8a8", type=Path, default=None,
                   help="its Ascend W8A8 checkpoint (default: written by "
                   "python -m tools.quantize.w8a8 --float-mtp)")
    p.add_argument("--k", type=bench.int_list, default=[1])
    p.add_argument("--batch-sizes", type=bench.int_list, default=[1, 8])
    p.add_argument("--new-tokens", "-n", type=int, default=32)
    p.add_argument("--repeats", "-r", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", choices=["cpu", "npu", "auto"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    cfg = bench.BenchConfig(model=args.model,
                                    ks=args.k,
                                    batch_sizes=args.batch_sizes,
                                    new_tokens=args.new_tokens,
                                    repeats=args.repeats,
                                    dtype=args.dtype,
                                    device=args.device)
    out = args.out or (bench.ROOT / "benchmarks" / "results" /
                       f"quantization-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with tempfile.TemporaryDirectory() as tmp:
        w8a8 = args.w8a8
        if w8a8 is None:
            w8a8 = Path(tmp) / "w8a8-float-mtp"
            quantize(args.model, w8a8)
        results = run(cfg, w8a8, out.with_suffix(".logs"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(format_tables(results))
    print(f"JSON: {out}")
    if any(r[f"{p}_same_as_no_mtp"] is False for r in results["rows"]
           for p in ("float", "w8a8")):
        raise SystemExit("tools.bench.quantization: MTP changed the greedy "
                         "tokens")
    return results


if __name__ == "__main__":
    main()
