"""The benchmark library: a configuration (``BenchConfig``), its prompts,
and runs of one engine configuration per fresh process.

Each engine configuration (no MTP, then MTP with each k) runs in a fresh
process (``python -m tools.bench.engine_child``) that, per batch size, makes
a warm-up run, then ``repeats`` pairs of timed greedy runs (temperature 0,
ignore_eos) over the same prompts: one with ``max_tokens=1`` (prefill and
first token) and one with ``max_tokens=N``. Decode tokens/s of a pair is
``B * (N - 1) / (T_N - T_1)``; the median over the pairs is reported. The
greedy outputs with MTP must equal those without; the comparison says so.
The command lines are ``tools.bench.mtp``, ``.graph_modes``, ``.parallel``
and ``.quantization``; see benchmarks/README.md.
"""

import argparse
import dataclasses
import json
import logging
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from tools.bench.report import compare, config_name, outputs_digest

# The parent never imports vLLM (every engine runs in a child process), so
# it logs with the standard library.
logger = logging.getLogger("tools.bench")

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / "tests" / "fixtures" / "tiny-glm45"
# The engine process, run as a module of this package from any working
# directory: the repository root goes on its PYTHONPATH.
CHILD = "tools.bench.engine_child"
HELDOUT = "heldout_prompts.json"
TIMING_METHOD = (
    "decode tokens/s = B*(N-1) / (T_N - T_1): wall time of a greedy run of N "
    "new tokens minus that of a run of 1 new token over the same B prompts "
    "(prefill and first token), paired per repeat, median over repeats "
    "(best_*: the fastest pair); *_per_cpu_s: the same with the engine "
    "process's CPU time instead of wall time; vllm_decode_tokens_per_s: "
    "B*(N-1) / mean of vLLM's per-request decode time (last token - first "
    "token) over the N-token runs")
SCHEMA_VERSION = 1
# The warning of vLLM's speculation watchdog when it pauses speculation.
WATCHDOG_PAUSED = "Speculative decoding paused"


@dataclasses.dataclass
class BenchConfig:
    model: Path = DEFAULT_MODEL
    ks: list[int] = dataclasses.field(default_factory=lambda: [1])
    batch_sizes: list[int] = dataclasses.field(
        default_factory=lambda: [1, 4, 16])
    new_tokens: int = 64
    repeats: int = 5
    warmup_tokens: int = 8
    dtype: str = "float32"
    kv_cache_bytes: int = 256 << 20
    max_model_len: Optional[int] = None
    method: str = "glm4_moe_mtp"
    device: str = "cpu"
    prompts_file: Optional[Path] = None
    timeout_s: int = 1800
    # One thread: on a shared 2-core host, torch's OpenMP threads spin when
    # another process holds a core and a step takes 10-50x longer.
    threads: Optional[int] = 1
    # "default" (vLLM's: graphs), "eager" (--enforce-eager) or a
    # cudagraph_mode name.
    graph_mode: str = "default"
    # Keep each batch's greedy token ids in the result (else a digest).
    keep_outputs: bool = False
    # "module:function" each engine process calls before it starts: a
    # deliberate change (the nightly's regression tests inject them).
    setup: Optional[str] = None
    # Engine arguments on top of these (a preset's parallel layout).
    engine_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)

    def validate(self) -> None:
        if not (self.model / "config.json").is_file():
            hint = (" (the committed fixture: build it with "
                    "python -m tests.fixtures.build_tiny_glm45, or pass "
                    "--model)"
                    if self.model == DEFAULT_MODEL else "")
            raise ValueError(f"no config.json in {self.model}{hint}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"--batch-sizes must be positive integers, got "
                             f"{self.batch_sizes}")
        if any(k < 1 for k in self.ks):
            raise ValueError(f"--k values must be >= 1 (no MTP always "
                             f"runs), got {self.ks}")
        if self.new_tokens < 2:
            raise ValueError("--new-tokens must be >= 2: decode throughput "
                             "is measured after the first token")
        if self.threads is not None and self.threads < 0:
            raise ValueError("--threads must be >= 0 (0: torch's default)")
        if self.repeats < 1 or self.warmup_tokens < 1:
            raise ValueError("--repeats and --warmup-tokens must be >= 1")


@dataclasses.dataclass
class Variant:
    """One engine configuration of a run: ``k`` draft tokens (0: no MTP),
    extra ``--speculative-config`` keys, and a setup ("module:function")
    called in this engine only, after ``BenchConfig.setup``. The default
    run is no MTP, then MTP with each of ``BenchConfig.ks``, without
    either."""
    k: int
    # The config's name in the table, the JSON and the log file; default
    # ``config_name(k)``.
    name: Optional[str] = None
    speculative: dict[str, Any] = dataclasses.field(default_factory=dict)
    setup: Optional[str] = None

    def __post_init__(self) -> None:
        if self.name is None:
            self.name = config_name(self.k)
        clash = {"method", "num_speculative_tokens"} & set(self.speculative)
        if clash:
            raise ValueError(f"{self.name}: {sorted(clash)} come from the "
                             "benchmark's --method and --k")


def default_variants(cfg: BenchConfig) -> list[Variant]:
    """No MTP, then MTP with each k of ``cfg.ks``."""
    return [Variant(k) for k in [0] + sorted(set(cfg.ks))]


def load_prompts(cfg: BenchConfig) -> tuple[list[list[int]], str]:
    """Token id prompts and where they came from: ``--prompts``, else the
    model's held-out prompts, else seeded random ids (with a warning)."""
    path = cfg.prompts_file or cfg.model / HELDOUT
    if path.is_file():
        data = json.loads(path.read_text())
        prompts = [p["token_ids"] if isinstance(p, dict) else p
                   for p in data]
        if not prompts or not all(
                isinstance(p, list) and p and all(
                    isinstance(t, int) for t in p) for p in prompts):
            raise ValueError(
                f"{path}: expected a non-empty JSON list of token id lists "
                "or of objects with a 'token_ids' list")
        return prompts, str(path)
    if cfg.prompts_file:
        raise ValueError(f"--prompts {cfg.prompts_file} does not exist")
    vocab = json.loads((cfg.model / "config.json").read_text())["vocab_size"]
    logger.warning("%s has no %s: using 16 seeded random prompts of 24 "
                   "tokens (acceptance on them means little)", cfg.model,
                   HELDOUT)
    rng = random.Random(0)
    return [[rng.randrange(1, vocab) for _ in range(24)]
            for _ in range(16)], "random(seed=0, 16x24)"


def engine_kwargs(cfg: BenchConfig, prompts: list[list[int]]) -> dict:
    longest = max(len(p) for p in prompts)
    need = longest + cfg.new_tokens + max(cfg.ks, default=0) + 1
    max_len = cfg.max_model_len or -(-need // 64) * 64
    if max_len < need:
        raise ValueError(f"--max-model-len {max_len} is below the longest "
                         f"prompt ({longest}) + --new-tokens + k; use >= "
                         f"{need}")
    engine = dict(model=str(cfg.model), skip_tokenizer_init=True,
                  dtype=cfg.dtype, max_model_len=max_len,
                  max_num_seqs=max(cfg.batch_sizes), seed=0,
                  enable_prefix_caching=False,
                  kv_cache_memory_bytes=cfg.kv_cache_bytes)
    engine.update(cfg.engine_overrides)
    if cfg.graph_mode == "eager":
        engine["enforce_eager"] = True
    elif cfg.graph_mode != "default":
        engine["compilation_config"] = {
            **engine.get("compilation_config", {}),
            "cudagraph_mode": cfg.graph_mode
        }
    return engine


def child_command(spec_path: str) -> list[str]:
    """The command line of one engine process reading ``spec_path``."""
    return [sys.executable, "-m", CHILD, spec_path]


def child_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the repository root first on PYTHONPATH, so that
    ``python -m tools.bench.engine_child`` (and a spec's ``setup`` module,
    e.g. ``tests.nightly.injections``) imports from any working directory.
    The root's ``vllm/`` folder is only a namespace package there: the
    regular package that ``make install``'s ``vllm-tree.pth`` puts on
    ``sys.path`` wins."""
    path = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p and p != str(ROOT)]
    return {**env, "PYTHONPATH": os.pathsep.join(path)}


def run_config(cfg: BenchConfig, k: int, prompts: list[list[int]],
               log_path: Path,
               variant: Optional[Variant] = None) -> dict[str, Any]:
    """One engine configuration in a fresh process; its result dict.
    ``variant`` (its k must be ``k``) adds ``--speculative-config`` keys, a
    setup of this engine and a name."""
    variant = variant or Variant(k)
    if variant.k != k:
        raise ValueError(f"{variant.name}: k {variant.k} != {k}")
    spec = {"engine": engine_kwargs(cfg, prompts), "method": cfg.method,
            "num_speculative_tokens": k, "prompts": prompts,
            "batch_sizes": cfg.batch_sizes, "new_tokens": cfg.new_tokens,
            "repeats": cfg.repeats, "warmup_tokens": cfg.warmup_tokens,
            "threads": cfg.threads, "setup": cfg.setup}
    if variant.speculative:
        spec["speculative_config"] = dict(variant.speculative)
    if variant.setup:
        spec["setup"] = [s for s in (cfg.setup, variant.setup) if s]
    env = dict(os.environ, VLLM_ASCEND_DEVICE=cfg.device,
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    # vLLM logs to stdout by default, where the child's protocol lines go
    # and anything else is dropped: its log goes to the engine's log file.
    env.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if cfg.threads:
        env["OMP_NUM_THREADS"] = str(cfg.threads)
    name = variant.name
    with tempfile.NamedTemporaryFile("w", suffix=".json",
                                     delete=False) as f:
        json.dump(spec, f)
    result = None
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(child_command(f.name),
                                    stdout=subprocess.PIPE, stderr=log,
                                    text=True, env=child_env(env))
            timer = threading.Timer(cfg.timeout_s, proc.kill)
            timer.start()
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("PROGRESS "):
                    _log_progress(name, json.loads(line[9:]))
                elif line.startswith("RESULT "):
                    result = json.loads(line[7:])
            code = proc.wait()
            timer.cancel()
    finally:
        os.unlink(f.name)
    if code != 0 or result is None:
        tail = log_path.read_text()[-4000:]
        raise RuntimeError(f"{name} failed (exit {code}, killed after "
                           f"--timeout {cfg.timeout_s} s if -9); log "
                           f"{log_path}:\n{tail}")
    result["name"] = name
    result["log"] = str(log_path)
    for line in log_path.read_text(errors="replace").splitlines():
        if WATCHDOG_PAUSED in line:
            # vLLM's speculation watchdog warns once per pause.
            logger.warning("%s: %s", name, line[line.index(WATCHDOG_PAUSED):])
    return result


def _log_progress(name: str, event: dict[str, Any]) -> None:
    if event["event"] == "engine_ready":
        logger.info("%s: engine ready in %.1f s", name, event["init_s"])
    elif event["event"] == "batch_done":
        acc = event.get("acceptance") or {}
        rate = acc.get("acceptance_rate")
        fwd = event.get("forward_time") or {}
        cost = ("" if fwd.get("target_ms_per_forward") is None else
                f", target forward {fwd['target_ms_per_forward']:.2f} ms")
        if fwd.get("draft_over_target") is not None:
            cost += (f", draft forward {fwd['draft_ms_per_forward']:.2f} ms "
                     f"({fwd['draft_over_target']:.0%} of a target forward)")
        chosen = (event.get("draft_length") or {}).get("steps_per_length")
        if chosen:
            # The adaptive draft length's decode steps per length 0..k.
            cost += ", decode steps per draft length " + "/".join(
                map(str, chosen))
        logger.info("%s: batch %d: %.1f decode tokens/s%s%s", name,
                    event["batch_size"], event["decode_tokens_per_s"],
                    "" if rate is None else f", acceptance {rate:.1%}", cost)


def run_benchmark(cfg: BenchConfig, log_dir: Path,
                  variants: Optional[list[Variant]] = None) -> dict[str, Any]:
    """Run every configuration and return the results (the JSON's content).
    ``variants``: the engine configurations, in order (default: no MTP,
    then MTP with each of ``cfg.ks``); ratios are over the first without
    MTP. Child logs go to ``log_dir``."""
    cfg.validate()
    if variants is None:
        variants = default_variants(cfg)
    else:
        _check_variants(cfg, variants)
    prompts, source = load_prompts(cfg)
    configs = []
    for variant in variants:
        logger.info("%s: starting (batch sizes %s, %d new tokens, %d "
                    "repeats)", variant.name, cfg.batch_sizes,
                    cfg.new_tokens, cfg.repeats)
        configs.append(run_config(cfg, variant.k, prompts,
                                  log_dir / f"{variant.name}.log", variant))
    comparison = compare(configs)
    for c in configs:
        for b in c["batches"]:
            b["outputs_sha1"] = outputs_digest(b["outputs"])
            if not cfg.keep_outputs:
                del b["outputs"]
    return {
        "schema_version": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": _machine(cfg.device, configs),
        "settings": {**{k: (str(v) if isinstance(v, Path) else v)
                        for k, v in dataclasses.asdict(cfg).items()},
                     "timing_method": TIMING_METHOD,
                     "engine": engine_kwargs(cfg, prompts),
                     "variants": [dataclasses.asdict(v) for v in variants]},
        "prompts": {"source": source, "count": len(prompts),
                    "mean_len": sum(map(len, prompts)) / len(prompts)},
        "configs": configs,
        "comparison": comparison,
        "outputs_identical":
        all(r["outputs_identical"] for r in comparison)
        if comparison else None,
    }


def _check_variants(cfg: BenchConfig, variants: list[Variant]) -> None:
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"configuration names must differ: {names}")
    if any(v.k < 0 for v in variants) or max(
            (v.k for v in variants), default=0) > max(cfg.ks, default=0):
        # engine_kwargs sizes max_model_len for the largest of cfg.ks.
        raise ValueError(f"every configuration's k must be in 0..max(--k) "
                         f"({max(cfg.ks, default=0)}): {names}")


def _machine(device: str, configs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"device": device, "cpu_count": os.cpu_count(),
            "torch_threads": configs[0].get("torch_threads"),
            "platform": platform.platform(),
            "python": platform.python_version()}


def default_out() -> Path:
    return (ROOT / "benchmarks" / "results" /
            f"{time.strftime('%Y%m%d-%H%M%S')}.json")


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers ('' is an empty list)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
