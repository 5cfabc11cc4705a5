"""DP 2 with expert parallelism vs DP 1, with and without MTP, in one run.

    .venv/bin/python -m tools.bench.parallel              # ~6 min
    .venv/bin/python -m tools.bench.parallel --batch-sizes 1,4 --k 1,2
    VLLM_ASCEND_MOE_COMM=allgather .venv/bin/python -m tools.bench.parallel

For each layout and MTP setting, ``tools/bench/engine_child.py``'s
measurement (paired greedy runs, median decode tokens/s) in fresh
processes: DP 1 runs one engine with 2B prompts per batch, DP 2 runs one
engine per rank (vLLM 0.11's offline DP: ``VLLM_DP_*``), B prompts each,
``--enable-expert-parallel``. Every process times the torch.distributed
collectives it calls (waiting for the other rank included): the share of
the timed window they take. The table puts DP2/DP1 and MTP/no-MTP side by
side with the acceptance and whether each prompt's greedy tokens equal DP
1's without MTP.

On this 2-core machine each DP rank has one core and DP 1 one core too, and
collectives run on gloo through the loopback: the ratio says how much the
exchange costs against the compute it splits, not what HCCL on an NPU
server gives.
"""

import argparse
import dataclasses
import json
import logging
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from tools.bench import run as bench
from tools.bench.report import config_name, fmt, grid

logger = logging.getLogger("tools.bench.parallel")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spec(cfg: bench.BenchConfig, k: int, prompts: list[list[int]],
          batch_sizes: list[int], engine: dict) -> dict[str, Any]:
    return {"engine": engine, "method": cfg.method,
            "num_speculative_tokens": k, "prompts": prompts,
            "batch_sizes": batch_sizes, "new_tokens": cfg.new_tokens,
            "repeats": cfg.repeats, "warmup_tokens": cfg.warmup_tokens,
            "threads": 1, "setup": None, "collectives": True,
            "keep_outputs": True, "retries": 1}


def _run_ranks(specs: list[dict], env: dict, log_dir: Path, name: str,
               timeout: int) -> list[dict]:
    """One engine_child per spec, started together; their RESULTs."""
    log_dir.mkdir(parents=True, exist_ok=True)
    procs, files = [], []
    for rank, spec in enumerate(specs):
        with tempfile.NamedTemporaryFile("w", suffix=".json",
                                         delete=False) as f:
            json.dump(spec, f)
        log = open(log_dir / f"{name}-rank{rank}.log", "w")  # noqa: SIM115
        rank_env = dict(env, VLLM_DP_RANK=str(rank),
                        VLLM_DP_RANK_LOCAL=str(rank))
        procs.append(subprocess.Popen(
            bench.child_command(f.name),
            stdout=subprocess.PIPE, stderr=log, text=True,
            env=bench.child_env(rank_env)))
        files.append((f.name, log))
    results = []
    deadline = time.monotonic() + timeout
    try:
        for rank, proc in enumerate(procs):
            out, _ = proc.communicate(
                timeout=max(1.0, deadline - time.monotonic()))
            lines = [line for line in out.splitlines()
                     if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(
                    f"{name} rank {rank} failed (exit {proc.returncode}); "
                    f"log {log_dir / f'{name}-rank{rank}.log'}")
            results.append(json.loads(lines[-1][7:]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for path, log in files:
            os.unlink(path)
            log.close()
    return results


def run(cfg: bench.BenchConfig, log_dir: Path) -> dict[str, Any]:
    prompts, source = bench.load_prompts(cfg)
    halves = [prompts[0::2], prompts[1::2]]
    # DP 1's prompt i*2 + r is DP rank r's prompt i: batch 2B holds the
    # same prompts as the two ranks' batches of B.
    dp1_prompts = [p for pair in zip(*halves) for p in pair]
    base_env = dict(os.environ, VLLM_ASCEND_DEVICE=cfg.device,
                    VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1")
    layouts = {}
    for k in [0] + sorted(set(cfg.ks)):
        name = config_name(k)
        engine = bench.engine_kwargs(
            dataclasses.replace(cfg, batch_sizes=[2 * b
                                                  for b in cfg.batch_sizes]),
            prompts)
        logger.info("DP 1, %s", name)
        layouts[("dp1", name)] = _run_ranks(
            [_spec(cfg, k, dp1_prompts, [2 * b for b in cfg.batch_sizes],
                   engine)],
            base_env, log_dir, f"dp1-{name}", cfg.timeout_s)
        logger.info("DP 2 + EP, %s", name)
        dp_env = dict(base_env, VLLM_DP_SIZE="2",
                      VLLM_DP_MASTER_IP="127.0.0.1",
                      VLLM_DP_MASTER_PORT=str(_free_port()))
        dp_engine = dict(engine, enable_expert_parallel=True,
                         max_num_seqs=max(cfg.batch_sizes))
        layouts[("dp2_ep", name)] = _run_ranks(
            [_spec(cfg, k, half, cfg.batch_sizes, dp_engine)
             for half in halves], dp_env, log_dir, f"dp2-{name}",
            cfg.timeout_s)
    return {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "settings": {"model": str(cfg.model), "k": cfg.ks,
                         "batch_sizes_per_rank": cfg.batch_sizes,
                         "new_tokens": cfg.new_tokens,
                         "repeats": cfg.repeats, "device": cfg.device,
                         "moe_comm": os.environ.get("VLLM_ASCEND_MOE_COMM"),
                         "prompts": source},
            "rows": rows(layouts, cfg.batch_sizes)}


def _batch(result: dict, size: int) -> dict:
    return next(b for b in result["batches"] if b["batch_size"] == size)


def rows(layouts: dict, batch_sizes: list[int]) -> list[dict[str, Any]]:
    no_mtp = config_name(0)
    out = []
    for (layout, name), ranks in layouts.items():
        for b in batch_sizes:
            size = b if layout == "dp2_ep" else 2 * b
            batches = [_batch(r, size) for r in ranks]
            tokens_per_s = sum(x["decode_tokens_per_s"] for x in batches)
            reference = _batch(layouts[("dp1", no_mtp)][0], 2 * b)
            if layout == "dp2_ep":
                outputs = [o for pair in zip(batches[0]["outputs"],
                                             batches[1]["outputs"])
                           for o in pair]
            else:
                outputs = batches[0]["outputs"]
            accepted = [x["acceptance"] for x in batches
                        if x.get("acceptance")]
            drafts = sum(a["num_draft_tokens"] for a in accepted)
            out.append({
                "layout": layout, "config": name, "batch_per_rank": b,
                "tokens_per_s": tokens_per_s,
                "collective_share": max(x["collective_share"]
                                        for x in batches),
                "acceptance_rate": (sum(a["num_accepted_tokens"]
                                        for a in accepted) / drafts
                                    if drafts else None),
                "same_as_dp1_no_mtp": outputs == reference["outputs"],
            })
    by_key = {(r["layout"], r["config"], r["batch_per_rank"]): r
              for r in out}
    for r in out:
        dp1 = by_key[("dp1", r["config"], r["batch_per_rank"])]
        base = by_key[(r["layout"], no_mtp, r["batch_per_rank"])]
        r["dp2_over_dp1"] = (r["tokens_per_s"] / dp1["tokens_per_s"]
                             if r["layout"] == "dp2_ep" else None)
        r["mtp_over_no_mtp"] = (r["tokens_per_s"] / base["tokens_per_s"]
                                if r["config"] != no_mtp else None)
    return out


def format_table(results: dict[str, Any]) -> str:
    header = ["layout", "config", "batch/rank", "tok/s", "DP2/DP1",
              "MTP/no-MTP", "collectives", "acc", "same as DP1"]
    body = [[r["layout"], r["config"], str(r["batch_per_rank"]),
             fmt(r["tokens_per_s"], ".1f"), fmt(r["dp2_over_dp1"]),
             fmt(r["mtp_over_no_mtp"]),
             fmt(r["collective_share"], ".1%"),
             fmt(r["acceptance_rate"], ".1%"),
             "yes" if r["same_as_dp1_no_mtp"] else "NO"]
            for r in results["rows"]]
    return grid(header, body)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=bench.DEFAULT_MODEL)
    p.add_argument("--k", type=bench.int_list, default=[1])
    p.add_argument("--batch-sizes", type=bench.int_list, default=[1, 4],
                   help="prompts per DP rank (DP 1 runs twice as many)")
    p.add_argument("--new-tokens", "-n", type=int, default=32)
    p.add_argument("--repeats", "-r", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "npu", "auto"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    cfg = bench.BenchConfig(model=args.model, ks=args.k,
                                    batch_sizes=args.batch_sizes,
                                    new_tokens=args.new_tokens,
                                    repeats=args.repeats, device=args.device)
    cfg.validate()
    out = args.out or (bench.ROOT / "benchmarks" / "results" /
                       f"parallel-{time.strftime('%Y%m%d-%H%M%S')}.json")
    results = run(cfg, out.with_suffix(".logs"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(format_table(results))
    print(f"JSON: {out}")
    if not all(r["same_as_dp1_no_mtp"] for r in results["rows"]):
        raise SystemExit("tools.bench.parallel: a layout or MTP changed the "
                         "greedy tokens")
    return results


if __name__ == "__main__":
    main()
