"""Rehearse the reference serve command (DP 2 x TP 8 + EP, W8A8, graph
capture sizes) at GLM-4.5's real depth through the torch_npu contract double
(not in CI: ``make rehearsal``).

    python -m tools.dev.rehearsal [--runs mtp,mtp-default-sizes,no-mtp]
        [--npu-memory-gib G] [--max-model-len N] [--max-num-batched-tokens N]

1. Builds (once, into a cache directory) a random GLM-4.5 checkpoint with
   the real config shape and scaled-down widths
   (``tools/dev/rehearsal/depth.py``) and quantizes it to W8A8 with a float
   MTP layer (``python -m tools.quantize.w8a8 --float-mtp``,
   ``--dynamic-only`` unless ``--calibrate``).
2. Serves it with the reference command's flags (DP 2 x TP 2 + EP, capture
   sizes, ``--quantization ascend``, MTP k=1, ...) on the NPU code paths
   (``VLLM_ASCEND_DEVICE=npu VLLM_ASCEND_NPU_DOUBLE=1``) in the default
   graph mode: with the report's capture sizes (``mtp``), with none given
   (``mtp-default-sizes``) and without MTP (``no-mtp``); sends a handful of
   greedy completions to each and checks that MTP's tokens equal no-MTP's.
3. Prints, per run and rank, what the server logged: graphs captured against
   the stream budget, device memory by use (weights, KV cache, graph pools,
   outside torch), and wall time per phase; plus the run's peak memory on
   this host (a background ``free -m`` sampler and the server's process
   tree). A run that passes ``--max-rss-gib`` (its processes' resident
   memory), leaves less than ``--min-available-gib`` on the host, or runs
   longer than ``--run-timeout`` is killed (its process group) and reported
   as such.

The emulated NPU's memory (``VLLM_ASCEND_NPU_DOUBLE_MEMORY_GIB``, from
``--npu-memory-gib``) is real memory here: the double's device memory is
the worker's resident memory. The preflight prints what the flags need per
rank (the KV cache of one ``--max-model-len`` sequence, which vLLM
requires, and the profile run's peak) against it.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

from tools.demo.serve import ServeProcess, free_port, spec_decode_metrics
from tools.dev.fetch_vllm_sdist import default_cache_dir
from tools.dev.rehearsal import depth as glm45_depth

ROOT = Path(__file__).resolve().parents[3]
GiB = 1 << 30
MiB = 1 << 20
SERVED_NAME = "dsv3"
CAPTURE_SIZES = [1, 4, 8, 16, 32, 48, 64]
MTP_CONFIG = {"num_speculative_tokens": 1, "method": "glm4_moe_mtp"}
# The reference serve command passes it; the plugin ignores additional_config
# (vLLM's own scheduler with chunked prefill is the default in v1).
ADDITIONAL_CONFIG = {"ascend_scheduler_config": {
    "enabled": True, "enable_chunked_prefill": True}}
PROMPTS = ["the quiet green frog", "one two three four five six",
           "what is the capital of", "red blue", "count to ten: one"]
RUNS = ("mtp", "mtp-default-sizes", "no-mtp")
# Not run by default: the MTP run with the plugin without its graph
# resource guards (tools/dev/rehearsal/unbounded), which must fail at capture.
UNBOUNDED = "mtp-unbounded"
UNBOUNDED_PATH = Path(__file__).resolve().parent / "unbounded"
DP, TP = 2, 2


@dataclasses.dataclass
class Flags:
    """The reference command's flags that this tool lets a user scale."""
    max_model_len: int = 35000
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 32
    gpu_memory_utilization: float = 0.9


def serve_args(model: Path, port: int, flags: Flags, mtp: bool,
               capture_sizes: Optional[list[int]]) -> list[str]:
    """The reference ``vllm serve`` command (its DP 2 x TP 8 at DP 2 x TP 2,
    the speculative config without its ``model`` key: the same
    checkpoint)."""
    args = [
        "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--data-parallel-size", str(DP), "--tensor-parallel-size", str(TP),
        "--enable-expert-parallel", "--seed", "1024",
        "--served-model-name", SERVED_NAME,
        "--max-model-len", str(flags.max_model_len),
        "--max-num-batched-tokens", str(flags.max_num_batched_tokens),
        "--max-num-seqs", str(flags.max_num_seqs),
        "--no-enable-prefix-caching", "--quantization", "ascend",
        "--trust-remote-code",
        "--gpu-memory-utilization", str(flags.gpu_memory_utilization),
        "--additional-config", json.dumps(ADDITIONAL_CONFIG),
        "--disable-uvicorn-access-log",
    ]
    if mtp:
        args += ["--speculative-config", json.dumps(MTP_CONFIG)]
    if capture_sizes is not None:
        args += ["--compilation-config",
                 json.dumps({"cudagraph_capture_sizes": capture_sizes})]
    return args


# --- preflight -------------------------------------------------------------


def preflight(config: dict[str, Any], flags: Flags, memory_gib: float,
              block_size: int = 128) -> list[str]:
    """What the flags need per rank against the emulated NPU (lines)."""
    layers = config["num_hidden_layers"] + config["num_nextn_predict_layers"]
    kv_heads = max(1, config["num_key_value_heads"] // TP)
    # bfloat16 K and V of every layer, MTP included, per token and rank.
    per_token = layers * 2 * kv_heads * config["head_dim"] * 2
    blocks = -(-flags.max_model_len // block_size)
    one_seq = blocks * block_size * per_token
    q_width = config["num_attention_heads"] // TP * config["head_dim"]
    qkv_width = q_width + 2 * kv_heads * config["head_dim"]
    # The double's W8A8 matmul accumulates in float64 ([T, N] twice, then
    # float32 and bfloat16): the profile run's largest temporaries.
    profile_peak = flags.max_num_batched_tokens * qkv_width * (8 * 2 + 4 + 2)
    budget = flags.gpu_memory_utilization * memory_gib * GiB
    real_tp = 8
    real_kv_heads = max(1, config["num_key_value_heads"] // real_tp)
    lines = [
        f"KV cache per token and rank: {per_token / 1024:.0f} KiB "
        f"({layers} layers x {kv_heads} KV heads x {config['head_dim']} x "
        f"K,V x bf16); one {flags.max_model_len}-token sequence (vLLM's "
        f"minimum): {one_seq / GiB:.2f} GiB per rank "
        f"({one_seq * real_kv_heads / kv_heads / GiB:.2f} GiB per NPU at "
        f"the report's TP {real_tp}, {real_kv_heads} KV head each)",
        f"profile run ({flags.max_num_batched_tokens} tokens): the double's "
        f"float64 QKV accumulator alone is about {profile_peak / GiB:.2f} "
        "GiB per rank",
        f"emulated NPU: {memory_gib:g} GiB x {flags.gpu_memory_utilization}"
        f" = {budget / GiB:.2f} GiB for weights, profile peak and KV",
    ]
    if one_seq + profile_peak > budget:
        lines.append(
            "does not fit: expect vLLM's 'To serve at least one request "
            "with the models's max seq len' or the plugin's 'No NPU memory "
            "is left for the KV cache' at startup (or the memory guard); "
            "scale with --npu-memory-gib, --max-model-len, "
            "--max-num-batched-tokens")
    return lines


# --- memory sampler and guard -----------------------------------------------


def _free_m() -> dict[str, int]:
    out = subprocess.run(["free", "-m"], capture_output=True, text=True,
                         timeout=10).stdout
    for line in out.splitlines():
        if line.startswith("Mem:"):
            cols = line.split()
            return {"total": int(cols[1]), "used": int(cols[2]),
                    "available": int(cols[6])}
    return {}


def _tree_rss(pid: int) -> int:
    """Proportional set size of the process tree (shared library pages
    counted once), else resident set size."""
    import psutil
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            try:
                total += proc.memory_full_info().pss
            except (AttributeError, psutil.AccessDenied):
                total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


class MemoryWatch:
    """Samples ``free -m`` and the server tree's RSS every ``period`` s
    into ``log``; kills the process group past the limits."""

    def __init__(self, pid: int, log: Path, max_rss: float,
                 min_available: float, period: float = 1.0) -> None:
        self.pid, self.log = pid, log
        self.max_rss, self.min_available = max_rss, min_available
        self.period = period
        self.peak_rss = 0
        self.peak_used_mib = 0
        self.min_available_mib: Optional[int] = None
        self.killed: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "MemoryWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def _run(self) -> None:
        start = time.monotonic()
        with open(self.log, "w") as f:
            f.write("seconds used_mib available_mib server_rss_mib\n")
            while not self._stop.is_set():
                mem = _free_m()
                rss = _tree_rss(self.pid)
                self.peak_rss = max(self.peak_rss, rss)
                if mem:
                    self.peak_used_mib = max(self.peak_used_mib, mem["used"])
                    avail = mem["available"]
                    self.min_available_mib = (avail if
                                              self.min_available_mib is None
                                              else min(avail,
                                                       self.min_available_mib))
                f.write(f"{time.monotonic() - start:.0f} {mem.get('used')} "
                        f"{mem.get('available')} {rss // MiB}\n")
                f.flush()
                reason = None
                if rss > self.max_rss:
                    reason = (f"server processes at {rss / GiB:.1f} GiB "
                              f"(PSS) > --max-rss-gib "
                              f"{self.max_rss / GiB:g}")
                elif mem and mem["available"] * MiB < self.min_available:
                    reason = (f"host memory available {mem['available']} "
                              f"MiB < --min-available-gib "
                              f"{self.min_available / GiB:g}")
                if reason and not self.killed:
                    self.killed = reason
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.pid, signal.SIGKILL)
                self._stop.wait(self.period)


# --- the server's log --------------------------------------------------------

PREFIX = re.compile(r"^\((?P<proc>[A-Za-z0-9_]+) pid=(?P<pid>\d+)\)"
                    r"\s*(?P<msg>.*)$")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
FLOAT = r"([0-9]+(?:\.[0-9]+)?)"
PATTERNS = {
    "weights_gib": re.compile(rf"Model loading took {FLOAT} GiB"),
    "load_s": re.compile(rf"Model loading took {FLOAT} GiB and {FLOAT} sec"),
    "kv_gib": re.compile(rf"Available KV cache memory: {FLOAT} GiB"),
    "kv_detail": re.compile(
        rf"Available KV cache memory: .*\(of {FLOAT} GiB requested: {FLOAT} "
        rf"GiB in use at start, {FLOAT} GiB torch peak, {FLOAT} GiB outside "
        r"torch\)"),
    "graph_capture": re.compile(
        rf"Graph capturing finished in {FLOAT} secs, took {FLOAT} GiB"),
    "kv_tokens": re.compile(r"GPU KV cache size: ([0-9,]+) tokens"),
    "init_s": re.compile(rf"init engine .* took {FLOAT} seconds"),
    "streams": re.compile(r"streams (\d+) of (\d+)"),
    "captured": re.compile(r"Captured (\d+) (MTP draft )?graph"),
    "pool": re.compile(rf"(?:graph )?pool {FLOAT} ?(B|KiB|MiB|GiB)\b"),
    "capture_s": re.compile(rf"Captured .* in {FLOAT} s"),
}
# The first line naming why a start failed (vLLM, the plugin, the double).
CAUSE = re.compile(r"out of memory|207008|207005|Alloc sq cq|To serve at "
                   r"least one request|No NPU memory is left|Worker failed "
                   r"with error|ValueError: |NotImplementedError: ")
UNIT = {"B": 1, "KiB": 1 << 10, "MiB": MiB, "GiB": GiB}


def parse_log(text: str) -> dict[str, Any]:
    """Per process (by pid, named by its last log prefix): the figures the
    plugin and vLLM log; the ``Captured``/capture-size lines verbatim; the
    last error lines."""
    procs: dict[str, dict[str, Any]] = {}
    errors: list[str] = []
    cause: Optional[str] = None
    for line in ANSI.sub("", text).splitlines():
        m = PREFIX.match(line)
        proc, msg = ((m.group("pid"), m.group("msg")) if m
                     else ("-", line))
        entry = procs.setdefault(proc, {"name": "(no prefix)", "lines": []})
        if m:
            entry["name"] = m.group("proc")
        if cause is None and CAUSE.search(msg):
            cause = line.strip()
        quiet = msg.startswith(("INFO", "WARNING", "DEBUG", "W1", "I1"))
        if (re.search(r"ERROR|Error|Traceback|Killed|207008|Alloc sq", msg)
                and not quiet) or "207008" in msg:
            errors.append(line.strip())
        keep = ("Captured" in msg or "streams" in msg
                or "capture size" in msg.lower()
                or "MoE communication" in msg)
        if keep:
            entry["lines"].append(msg.strip())
        for key, pattern in PATTERNS.items():
            found = pattern.search(msg)
            if not found:
                continue
            # The runner's line counts the draft's graphs, pool and time
            # too; the draft's own line comes first.
            draft = "MTP draft" in msg
            if key == "captured":
                entry["draft_graphs" if draft else "graphs"] = int(
                    found.group(1))
            elif key == "pool" and "Captured" in msg:
                entry["draft_pool_bytes" if draft else "pool_bytes"] = (
                    float(found.group(1)) * UNIT[found.group(2)])
            elif key == "capture_s" and not draft:
                entry["capture_s"] = float(found.group(1))
            elif key == "streams":
                entry["streams"] = (int(found.group(1)), int(found.group(2)))
            elif key == "kv_detail":
                entry.update(requested_gib=float(found.group(1)),
                             start_gib=float(found.group(2)),
                             peak_gib=float(found.group(3)),
                             outside_gib=float(found.group(4)))
            elif key == "graph_capture":
                entry.update(vllm_capture_s=float(found.group(1)),
                             vllm_graph_gib=float(found.group(2)))
            elif key == "load_s":
                entry["load_s"] = float(found.group(2))
            elif key == "kv_tokens":
                entry["kv_tokens"] = int(found.group(1).replace(",", ""))
            elif key != "pool":
                entry[key] = float(found.group(1))
    return {"procs": procs, "errors": errors[-8:], "cause": cause}


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def rank_table(parsed: dict[str, Any]) -> list[str]:
    """One row per worker (and the engine cores' KV token counts)."""
    rows = ["| process | weights GiB | KV cache GiB | graph pool MiB "
            "(plugin, draft incl.) | graphs GiB (vLLM) | outside torch GiB "
            "| profile peak GiB | graphs (of them draft) | streams used of "
            "budget | load s | capture s |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for pid, e in sorted(parsed["procs"].items(),
                         key=lambda kv: kv[1]["name"]):
        if not e["name"].startswith(("Worker", "EngineCore")):
            continue
        if e["name"].startswith("EngineCore"):
            if "kv_tokens" in e:
                rows.append(f"| {e['name']} | | {e['kv_tokens']} tokens "
                            "| | | | | | | | |")
            continue
        streams = e.get("streams")
        rows.append(
            f"| {e['name']} | {_fmt(e.get('weights_gib'))} | "
            f"{_fmt(e.get('kv_gib'))} | "
            f"{_fmt(e['pool_bytes'] / MiB if 'pool_bytes' in e else None)}"
            f" | {_fmt(e.get('vllm_graph_gib'))} | "
            f"{_fmt(e.get('outside_gib'))} | {_fmt(e.get('peak_gib'))} | "
            f"{e.get('graphs', '-')} ({e.get('draft_graphs', 0)}) | "
            f"{f'{streams[0]} of {streams[1]}' if streams else 'not logged'}"
            f" | {_fmt(e.get('load_s'), '.0f')} | "
            f"{_fmt(e.get('capture_s'), '.0f')} |")
    return rows


# --- one run -----------------------------------------------------------------


@dataclasses.dataclass
class RunResult:
    name: str
    log: Path
    status: str = "not started"
    startup_s: Optional[float] = None
    requests_s: Optional[float] = None
    outputs: Optional[list[list[int]]] = None
    texts: Optional[list[str]] = None
    logprobs: Optional[list[list[dict[str, float]]]] = None
    spec: dict[str, float] = dataclasses.field(default_factory=dict)
    peak_rss: int = 0
    peak_used_mib: int = 0
    min_available_mib: Optional[int] = None
    parsed: dict[str, Any] = dataclasses.field(default_factory=dict)


def _complete(base_url: str, prompt: str, max_tokens: int,
              logprobs: bool) -> dict[str, Any]:
    import httpx
    body = {"model": SERVED_NAME, "prompt": prompt, "temperature": 0,
            "max_tokens": max_tokens, "ignore_eos": True,
            "return_token_ids": True}
    if logprobs:
        body["logprobs"] = 2
        body["return_tokens_as_token_ids"] = True
    reply = httpx.post(f"{base_url}/v1/completions", json=body,
                       timeout=900)
    reply.raise_for_status()
    return reply.json()["choices"][0]


def _worker_failure(log: str) -> Optional[str]:
    """The cause a failed worker printed, if any: its peers then wait in a
    collective and the server never exits by itself."""
    cause = CAUSE.search(ANSI.sub("", log))
    return cause.group(0) if cause else None


def run_one(name: str, model: Path, flags: Flags, env: dict[str, str],
            args: argparse.Namespace, logs: Path) -> RunResult:
    mtp = name != "no-mtp"
    sizes = None if name == "mtp-default-sizes" else CAPTURE_SIZES
    result = RunResult(name, logs / f"{name}.log")
    port = free_port()
    cli = serve_args(model, port, flags, mtp, sizes)
    print(f"[rehearsal] {name}: vllm " + " ".join(
        f"'{a}'" if a.startswith("{") else a for a in cli), flush=True)
    print(f"[rehearsal] {name}: log {result.log}", flush=True)
    if name == UNBOUNDED:
        env = {**env, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(UNBOUNDED_PATH), os.environ.get("PYTHONPATH")]))}
    server = ServeProcess(cli, port, env=env, log_path=result.log)
    watch = MemoryWatch(server.proc.pid, logs / f"{name}.memory",
                        args.max_rss_gib * GiB, args.min_available_gib * GiB)
    start = time.monotonic()
    try:
        with watch:
            try:
                result.startup_s = server.wait_healthy(
                    args.run_timeout, failed=_worker_failure)
            except (RuntimeError, TimeoutError) as e:
                result.status = ("killed: " + watch.killed if watch.killed
                                 else "startup failed: " +
                                 str(e).splitlines()[0])
                return result
            print(f"[rehearsal] {name}: healthy after "
                  f"{result.startup_s:.0f} s", flush=True)
            t0 = time.monotonic()
            left = args.run_timeout - (t0 - start)
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                futures = [pool.submit(_complete, server.base_url, p,
                                       args.max_tokens, not mtp)
                           for p in PROMPTS[:args.prompts]]
                try:
                    choices = [f.result(timeout=max(left, 1))
                               for f in futures]
                except Exception as e:  # noqa: BLE001 - reported
                    result.status = ("killed: " + watch.killed
                                     if watch.killed else
                                     f"requests failed: {e!r}"[:300])
                    return result
            result.requests_s = time.monotonic() - t0
            result.outputs = [c["token_ids"] for c in choices]
            result.texts = [c["text"] for c in choices]
            if not mtp:
                result.logprobs = [
                    [{k.removeprefix("token_id:"): v for k, v in top.items()}
                     for top in c["logprobs"]["top_logprobs"]]
                    for c in choices]
            result.spec = spec_decode_metrics(server.get("/metrics"))
            result.status = "served"
    finally:
        server.stop(grace=20)
        result.peak_rss = watch.peak_rss
        result.peak_used_mib = watch.peak_used_mib
        result.min_available_mib = watch.min_available_mib
        result.parsed = parse_log(result.log.read_text(errors="replace"))
    return result


def compare(mtp: RunResult, base: RunResult,
            near_tie: float = 0.25) -> list[str]:
    """MTP's greedy tokens against no-MTP's, request by request; a
    difference at a near tie (top-2 log-probs within ``near_tie``, as in
    tests/utils/npu.py) is named as such."""
    lines = []
    for i, (got, want) in enumerate(zip(mtp.outputs, base.outputs)):
        if got == want:
            lines.append(f"request {i}: equal ({len(got)} tokens)")
            continue
        j = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b),
                 min(len(got), len(want)))
        top = base.logprobs[i][j] if j < len(want) else {}
        gap = (top.get(str(want[j]), 0) - top[str(got[j])]
               if j < len(got) and str(got[j]) in top else None)
        near = gap is not None and gap <= near_tie
        lines.append(f"request {i}: DIFFERS at token {j} ({got[j:j + 4]} vs"
                     f" {want[j:j + 4]}); no-MTP top-2 gap "
                     f"{_fmt(gap, '.3f')}"
                     f"{' (near tie)' if near else ''}")
    return lines


# --- main --------------------------------------------------------------------


def _quantize(src: Path, dst: Path, calibrate: bool) -> bool:
    """(re)writes dst from src; False when dst is already src's."""
    stamp = dst / "quantized_from.json"
    want = {"src": json.loads((src / glm45_depth.BUILD_INFO).read_text()
                              )["params"], "calibrate": calibrate}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return False
    cmd = [sys.executable, "-m", "tools.quantize.w8a8",
           "--model", str(src.resolve()), "--out", str(dst.resolve()),
           "--float-mtp"]
    if not calibrate:
        cmd.append("--dynamic-only")
    subprocess.run(cmd, check=True, cwd=ROOT)
    stamp.write_text(json.dumps(want) + "\n")
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.dev.rehearsal",
        description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path,
                        default=default_cache_dir() / "glm45-depth",
                        help="cache directory of the checkpoints")
    parser.add_argument("--logs", type=Path,
                        help="server logs (default: <out>/logs-<time>)")
    parser.add_argument("--hidden-size", type=int,
                        default=glm45_depth.DEFAULT_HIDDEN)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calibrate", action="store_true",
                        help="static W8A8 attention (calibrated); default "
                        "--dynamic-only")
    parser.add_argument("--runs", default=",".join(RUNS),
                        help=f"comma-separated, of {', '.join(RUNS)} "
                        f"and {UNBOUNDED} (the plugin without its graph "
                        "resource guards: must fail at capture)")
    parser.add_argument("--npu-memory-gib", type=float, default=2.0,
                        help="VLLM_ASCEND_NPU_DOUBLE_MEMORY_GIB per rank")
    parser.add_argument("--max-model-len", type=int, default=35000)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--gpu-memory-utilization", type=float,
                        default=0.9)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--run-timeout", type=float, default=1500,
                        help="seconds per server run (startup + requests)")
    parser.add_argument("--max-rss-gib", type=float, default=12,
                        help="kill a run whose processes hold more (PSS)")
    parser.add_argument("--min-available-gib", type=float, default=2.5,
                        help="kill a run when the host has less available")
    args = parser.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    unknown = [r for r in runs if r not in (*RUNS, UNBOUNDED)]
    if unknown:
        parser.error(f"unknown run {unknown[0]!r}; choose from {RUNS}")
    flags = Flags(max_model_len=args.max_model_len,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  gpu_memory_utilization=args.gpu_memory_utilization)
    times: dict[str, float] = {}

    t0 = time.monotonic()
    float_dir, built = glm45_depth.build(
        args.out / f"float-h{args.hidden_size}-s{args.seed}",
        hidden_size=args.hidden_size, seed=args.seed)
    times["build"] = time.monotonic() - t0
    info = json.loads((float_dir / glm45_depth.BUILD_INFO).read_text())
    print(f"[rehearsal] checkpoint {float_dir} "
          f"({'built' if built else 'reused'}): "
          f"{info['parameters'] / 1e6:.0f} M parameters, "
          f"{info['bytes'] / 2**20:.0f} MiB", flush=True)
    t0 = time.monotonic()
    quant_dir = args.out / (f"w8a8-float-mtp-h{args.hidden_size}-s"
                            f"{args.seed}{'-static' if args.calibrate else ''}")
    quantized = _quantize(float_dir, quant_dir, args.calibrate)
    times["quantize"] = time.monotonic() - t0
    print(f"[rehearsal] W8A8 {quant_dir} "
          f"({'quantized' if quantized else 'reused'})", flush=True)

    config = json.loads((quant_dir / "config.json").read_text())
    print("[rehearsal] preflight:")
    for line in preflight(config, flags, args.npu_memory_gib):
        print(f"  {line}")
    logs = args.logs or args.out / f"logs-{time.strftime('%Y%m%d-%H%M%S')}"
    logs.mkdir(parents=True, exist_ok=True)
    env = {"VLLM_ASCEND_DEVICE": "npu", "VLLM_ASCEND_NPU_DOUBLE": "1",
           "VLLM_ASCEND_NPU_DOUBLE_MEMORY_GIB": f"{args.npu_memory_gib:g}",
           "OMP_NUM_THREADS": "1", "VLLM_ASCEND_TRACEBACK": "1"}
    results = {}
    for name in runs:
        results[name] = run_one(name, quant_dir, flags, env, args, logs)
        r = results[name]
        print(f"[rehearsal] {name}: {r.status}", flush=True)
        (logs / "results.json").write_text(json.dumps(
            {n: dataclasses.asdict(v) for n, v in results.items()},
            default=str, indent=1) + "\n")

    print("\n## Rehearsal: the reference command at GLM-4.5's depth through "
          "the torch_npu double")
    print(f"DP {DP} x TP {TP} + EP, W8A8 with float MTP, hidden "
          f"{args.hidden_size}, emulated NPU {args.npu_memory_gib:g} GiB, "
          f"gpu-memory-utilization {flags.gpu_memory_utilization}, "
          f"max-model-len {flags.max_model_len}, max-num-batched-tokens "
          f"{flags.max_num_batched_tokens}; logs in {logs}\n")
    print("| phase | wall s |\n|---|---|")
    print(f"| build | {times['build']:.0f} |")
    print(f"| quantize | {times['quantize']:.0f} |")
    for name, r in results.items():
        print(f"| {name}: startup (load, profile, KV, capture) | "
              f"{_fmt(r.startup_s, '.0f')} |")
        print(f"| {name}: requests ({args.prompts} x {args.max_tokens} "
              f"tokens) | {_fmt(r.requests_s, '.0f')} |")
    for name, r in results.items():
        print(f"\n### {name}: {r.status}")
        print(f"peak memory of the server's processes (PSS) "
              f"{r.peak_rss / GiB:.2f} GiB; host: peak used "
              f"{r.peak_used_mib} MiB, lowest available "
              f"{r.min_available_mib} MiB (free -m)")
        print("\n".join(rank_table(r.parsed)))
        lines = sorted({ln for e in r.parsed["procs"].values()
                        for ln in e["lines"]})
        if lines:
            print("logged:")
            for ln in lines[:12]:
                print(f"  {ln[:300]}")
        if not any("streams" in ln for ln in lines):
            print("not logged: the stream budget ('Captured ... streams N "
                  "of B')")
        if r.parsed.get("cause"):
            print(f"cause: {r.parsed['cause'][:500]}")
        if r.parsed["errors"]:
            print("last error lines:")
            for ln in r.parsed["errors"]:
                print(f"  {ln[:300]}")
        if r.spec:
            drafted = r.spec.get("vllm:spec_decode_num_draft_tokens_total", 0)
            accepted = r.spec.get(
                "vllm:spec_decode_num_accepted_tokens_total", 0)
            print(f"MTP: {drafted:.0f} draft tokens, {accepted:.0f} accepted")
    ok = True
    base = results.get("no-mtp")
    for name in ("mtp", "mtp-default-sizes"):
        r = results.get(name)
        if r is None or base is None:
            continue
        print(f"\n### {name} == no-MTP (greedy, {args.max_tokens} tokens)")
        if r.outputs is None or base.outputs is None:
            print("not compared: a run did not serve")
            ok = False
            continue
        lines = compare(r, base)
        print("\n".join(lines))
        ok &= all("equal" in ln for ln in lines)
    served = all(r.status == "served" for r in results.values())
    print(f"\n[rehearsal] {'PASS' if served and ok else 'FAIL'}: "
          f"{sum(r.status == 'served' for r in results.values())} of "
          f"{len(results)} runs served; MTP == no-MTP: "
          f"{'yes' if ok and base else 'no' if base else 'not compared'}")
    return 0 if served and ok else 1


if __name__ == "__main__":
    sys.exit(main())
