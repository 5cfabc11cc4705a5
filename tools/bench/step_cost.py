"""Per-step device cost of GLM-4.5 W8A8 decode, with and without MTP,
counted through the torch_npu double.

    .venv/bin/python -m tools.bench.step_cost                  # vs main
    .venv/bin/python -m tools.bench.step_cost --against HEAD~3
    .venv/bin/python -m tools.bench.step_cost --against ''     # this tree only
    .venv/bin/python -m tools.bench.step_cost --k 1 --no-bytes  # quick

For a decode step, an MTP verify step and its draft steps, it reports:
device kernels per decoder layer (dense, MoE) and per step; host-device
syncs inside the step's device work (target forward, sampler and rejection
sampler, every draft step) with their call sites, and the step's output
read apart; the bytes each MoE exchange method hands over per token, with
the dtype dispatched; the format of every int8 and float weight; and the
host time per step outside the device work (the model forwards, logits and
sampling), with and without MTP.

How: every engine runs in its own process with
``VLLM_ASCEND_DEVICE=npu VLLM_ASCEND_NPU_DOUBLE=1`` and the double's cost
meter (``tests/npu_double/torch_npu/_cost.py``) on its decode steps.
Per-step kernels, syncs and host time come from the default graph mode
(vLLM's FULL_AND_PIECEWISE: a decode step replays a full graph, whose
recorded nodes are its kernels); per-layer kernels from an eager run
(compilation level 0) of the same steps, with forward hooks on the decoder
layers, and the two must agree on the forward's total. The MoE bytes come
from a data-parallel pair of engines with expert parallelism per method
(MC2 on an emulated Atlas A3, hidden size 1024). ``--against REF`` runs the
same report in a temporary ``git worktree`` of REF (this venv, REF's double)
and prints both columns and their ratio. Writes ``--out`` (JSON).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
DOUBLE = Path("tests") / "npu_double" / "torch_npu"
# A GLM-4.5-like decoder at test size: one dense layer then MoE layers, 16
# routed experts (top 8) and a shared expert, head dim 128 (the fused
# attention's), bfloat16 served; W8A8 with a float MTP layer.
MODEL_SHAPE = dict(num_hidden_layers=3, first_k_dense_replace=1,
                   n_routed_experts=16, num_experts_per_tok=8,
                   head_dim=128, hidden_size=256, intermediate_size=512,
                   moe_intermediate_size=64)
# MC2 needs H >= 1024 on an Atlas A3 (op-plugin 7.2.0).
BYTES_SHAPE = dict(MODEL_SHAPE, num_hidden_layers=2, hidden_size=1024)
METHODS = ("mc2", "alltoall", "allgather")
PROMPTS = [[11, 22, 33, 44, 55, 66], [7, 8, 9], [100, 101, 102, 103],
           [5, 6, 7, 8, 9, 10, 11, 12]]
NEW_TOKENS = 12
# Decode steps metered after the first few (the rest are timed only: the
# meter slows the host).
METERED_STEPS = (3, 4)
NZ_FORMATS = {29: "FRACTAL_NZ", 2: "ND", 0: "NCHW", 1: "NHWC"}


# -- the engine process ----------------------------------------------------
def _decode_step(scheduler_output, k: int) -> bool:
    """All scheduled requests decode (1 + k tokens each), none new."""
    counts = scheduler_output.num_scheduled_tokens
    return (bool(counts) and not scheduler_output.scheduled_new_reqs
            and all(n <= 1 + k for n in counts.values()))


def _wrap_call(obj: Any, before: Callable, after: Callable) -> None:
    """Run ``before``/``after`` around each call of a module or a graph
    wrapper (which is called through its class's ``__call__``)."""
    base = type(obj)

    def call(self, *args, **kwargs):
        token = before()
        try:
            return base.__call__(self, *args, **kwargs)
        finally:
            after(token)

    obj.__class__ = type(base.__name__, (base, ), {"__call__": call})


def _weight_formats(model) -> dict[str, Any]:
    """Format of every int8 and floating weight (torch_npu.get_npu_format
    where the double has it, else ND)."""
    import torch
    import torch_npu
    get_format = getattr(torch_npu, "get_npu_format", None)
    out: dict[str, Any] = {"int8": {}, "float": {}}
    for name, p in model.named_parameters():
        if p.dtype == torch.int8:
            kind = "int8"
        elif p.dtype.is_floating_point and p.dim() >= 2:
            kind = "float"
        else:
            continue
        fmt = "ND" if get_format is None else NZ_FORMATS.get(
            int(get_format(p)), str(get_format(p)))
        entry = out[kind].setdefault(fmt, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += p.nbytes
        if kind == "int8" and fmt != "FRACTAL_NZ":
            out.setdefault("int8_not_nz", []).append(name)
    return out


class StepProbe:
    """Installed in the worker: meters and times the runner's decode
    steps (the engine core runs in this process)."""

    def __init__(self, worker, k: int, per_layer: bool) -> None:
        import torch
        from torch_npu._cost import CostMeter
        self.runner = runner = worker.model_runner
        self.k = k
        self.meter = CostMeter()
        self.decode_steps = 0
        self.steps: list[dict[str, Any]] = []
        self.times: list[dict[str, float]] = []
        self.forward_s = 0.0
        self.metering = False
        self.last_start: Optional[float] = None
        self.draft_index = 0
        drafter = getattr(runner, "drafter", None)
        models = [runner.model] + ([drafter.model] if drafter else [])
        for model in models:
            for t in list(model.parameters()) + list(model.buffers()):
                self.meter.on_device(t)
        for owner in (runner, runner.input_batch, drafter):
            if owner is None:
                continue
            for name, value in vars(owner).items():
                gpu = getattr(value, "gpu", None)
                if isinstance(gpu, torch.Tensor):
                    self.meter.on_device(gpu)
                elif isinstance(value, torch.Tensor) and not any(
                        s in name for s in ("cpu", "_np", "pinned")):
                    self.meter.on_device(value)
        for cache in runner.kv_caches:
            self.meter.on_device(cache)
        self._wrap(runner, drafter)
        if per_layer:
            self._hook_layers(runner.model, "target")
            if drafter is not None:
                self._hook_layers(drafter.model, "draft")

    def _scoped(self, label: str, device: bool = False, timed: bool = False,
                on_exit: Optional[Callable] = None):
        meter = self.meter

        def before():
            scope = meter.scope(label, device=device) if self.metering \
                else None
            if scope is not None:
                scope.__enter__()
            return scope, time.perf_counter()

        def after(token):
            scope, start = token
            if timed:
                self.forward_s += time.perf_counter() - start
            if scope is not None:
                scope.__exit__(None, None, None)
            if on_exit:
                on_exit()

        return before, after

    def _wrap(self, runner, drafter) -> None:
        _wrap_call(runner.model, *self._scoped("forward", device=True,
                                               timed=True))
        if drafter is not None:
            _wrap_call(drafter.model, *self._scoped(
                "draft_forward", device=True, timed=True,
                on_exit=self._next_draft))
        # Logits and sampling are device work too: on the NPU they are a
        # few launches of host time, in the double the whole computation.
        self._time_device_work(runner, drafter)
        for name, label in (("_sample", "sample"),
                            ("propose_draft_token_ids", "draft"),
                            ("take_draft_token_ids", "output_read")):
            if hasattr(runner, name):
                self._wrap_method(runner, name, label)
        original = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            if not _decode_step(scheduler_output, self.k):
                self.last_start = None
                return original(scheduler_output, *args, **kwargs)
            return self._step(original, scheduler_output, *args, **kwargs)

        runner.execute_model = execute_model

    def _time_device_work(self, runner, drafter) -> None:
        """Count the logits and the (rejection) sampler as device time, as
        the forwards are: the host time per step is what is left."""

        def timed(call: Callable) -> Callable:

            def inner(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return call(*args, **kwargs)
                finally:
                    self.forward_s += time.perf_counter() - start

            return inner

        for model in (runner.model, getattr(drafter, "model", None)):
            if model is not None and hasattr(model, "compute_logits"):
                model.compute_logits = timed(model.compute_logits)
        for name in ("sampler", "rejection_sampler"):
            module = getattr(runner, name, None)
            if module is not None:
                module.forward = timed(module.forward)

    def _wrap_method(self, runner, name: str, label: str) -> None:
        original = getattr(runner, name)

        def method(*args, **kwargs):
            if not self.metering:
                return original(*args, **kwargs)
            self.draft_index = 0
            self.meter.tag = None
            try:
                with self.meter.scope(label):
                    return original(*args, **kwargs)
            finally:
                self.meter.tag = None

        setattr(runner, name, method)

    def _next_draft(self) -> None:
        """After draft forward i, the host work is draft step i + 1's."""
        self.draft_index += 1
        self.meter.tag = f"draft{self.draft_index + 1}"

    def _step(self, original, *args, **kwargs):
        start = time.perf_counter()
        if self.last_start is not None and not self.metering:
            # The previous step's period: the engine's whole step (scheduler,
            # runner, output processing) from one decode step to the next.
            self.times[-1]["period_s"] = start - self.last_start
        self.decode_steps += 1
        self.metering = self.decode_steps in METERED_STEPS
        self.forward_s = 0.0
        if self.metering:
            self.meter.reset()
            self.meter.tag = None
            with self.meter, self.meter.scope("runner"):
                out = original(*args, **kwargs)
            step = {name: cost.as_dict()
                    for name, cost in self.meter.costs.items()}
            step["_tokens"] = {"tokens": int(
                args[0].total_num_scheduled_tokens), "kernels": 0,
                "syncs": [], "exchanges": [], "calls": 0}
            self.steps.append(step)
            self.metering = False
            self.last_start = None
            return out
        out = original(*args, **kwargs)
        self.times.append({"forward_s": self.forward_s})
        self.last_start = start
        return out

    def _hook_layers(self, model, owner: str) -> None:
        layers = getattr(getattr(model, "model", model), "layers", None)
        if layers is None:
            return
        items = (layers.items() if hasattr(layers, "items") else
                 enumerate(layers))
        for index, layer in items:
            kind = ("moe" if hasattr(getattr(layer, "mlp", None), "experts")
                    or "MoE" in type(getattr(layer, "mlp", layer)).__name__
                    else "dense")
            if not hasattr(layer, "mlp"):
                kind = "mtp"
            label = f"layer.{owner}.{index}.{kind}"
            scopes: list[Any] = []

            def pre(_module, _args, label=label, scopes=scopes):
                if self.metering:
                    scope = self.meter.scope(label, device=True)
                    scope.__enter__()
                    scopes.append(scope)

            def post(_module, _args, _out, scopes=scopes):
                if scopes:
                    scopes.pop().__exit__(None, None, None)

            layer.register_forward_pre_hook(pre)
            layer.register_forward_hook(post)

    def report(self) -> dict[str, Any]:
        runner = self.runner
        drafter = getattr(runner, "drafter", None)
        periods = [t["period_s"] - t["forward_s"] for t in self.times
                   if "period_s" in t]
        return {
            "moe_layers": sum(
                hasattr(getattr(layer, "mlp", None), "experts")
                for layer in getattr(getattr(runner.model, "model", None),
                                     "layers", [])),
            "metered_steps": self.steps,
            "host_s_per_step": statistics.median(periods) if periods
            else None,
            "timed_steps": len(periods),
            "weights": {
                "target": _weight_formats(runner.model),
                "draft": (_weight_formats(drafter.model)
                          if drafter is not None else None)},
        }


_PROBE: list[StepProbe] = []


def _install(worker, k: int, per_layer: bool) -> bool:
    _PROBE.append(StepProbe(worker, k, per_layer))
    return True


def _report(worker) -> dict[str, Any]:
    return _PROBE[-1].report()


def _separate_host_and_device_buffers() -> None:
    """vLLM's CpuGpuBuffer makes its device half with ``cpu.to(device)``,
    which in the double (device tensors are CPU tensors) returns the host
    tensor itself: give it its own storage, as on a device, so that a read
    of the host half is not taken for a device read."""
    from vllm.v1 import utils
    init = utils.CpuGpuBuffer.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.gpu.untyped_storage().data_ptr() == (
                self.cpu.untyped_storage().data_ptr()):
            self.gpu = self.cpu.clone()

    utils.CpuGpuBuffer.__init__ = __init__


def child_main(spec_path: str) -> None:
    """One engine configuration (``--child SPEC``): generate greedily with
    the probe installed; print ``RESULT <json>``."""
    from vllm import LLM, SamplingParams
    spec = json.loads(Path(spec_path).read_text())
    import torch
    torch.set_num_threads(1)
    engine = dict(spec["engine"])
    k = spec["k"]
    if k:
        engine["speculative_config"] = {"method": "glm4_moe_mtp",
                                        "num_speculative_tokens": k}
    _separate_host_and_device_buffers()
    llm = LLM(**engine)
    llm.collective_rpc(_install, args=(k, spec["per_layer"]))
    params = SamplingParams(temperature=0, max_tokens=spec["new_tokens"],
                            ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p}
                            for p in spec["prompts"]], params,
                           use_tqdm=False)
    result = llm.collective_rpc(_report)[0]
    result["outputs"] = [list(o.outputs[0].token_ids) for o in outputs]
    print("RESULT " + json.dumps(result), flush=True)


# -- the parent: checkpoints, engine processes, the report ------------------
def write_checkpoint(path: Path, shape: dict[str, Any]) -> Path:
    """A random GLM-4.5 checkpoint at ``shape``, W8A8 with a float MTP
    layer (tools.quantize.w8a8 --float-mtp)."""
    if (path / "config.json").is_file():
        return path
    import contextlib
    import io

    from tests.utils.checkpoints import write_random_glm45
    from tools.quantize import w8a8
    float_dir = write_random_glm45(path.with_name(path.name + "-float"),
                                   seed=1, **shape)
    with contextlib.redirect_stdout(io.StringIO()):
        w8a8.main(["--model", str(float_dir), "--out", str(path),
                   "--float-mtp", "--dynamic-only"])
    return path


def _env(tree: Path, extra: Optional[dict[str, str]] = None
         ) -> dict[str, str]:
    return {**os.environ, "VLLM_ASCEND_DEVICE": "npu",
            "VLLM_ASCEND_NPU_DOUBLE": "1",
            "VLLM_ASCEND_NPU_DOUBLE_PACKAGE": str(tree / DOUBLE),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(tree), **(extra or {})}


def _last_result(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError("no RESULT line")


def run_child(tree: Path, spec: dict[str, Any], timeout: int,
              log: Path) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".json",
                                     delete=False) as f:
        json.dump(spec, f)
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench.step_cost", "--child", f.name],
        cwd=tree, env=_env(tree), capture_output=True, text=True,
        timeout=timeout)
    os.unlink(f.name)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"engine failed (log: {log}):\n"
                           f"{proc.stderr[-3000:]}")
    return _last_result(proc.stdout)


def run_bytes(tree: Path, model: Path, method: str, timeout: int,
              log: Path) -> dict[str, Any]:
    """Two DP ranks with expert parallelism on an emulated Atlas A3, the
    MoE method forced, eager; the meter on every decode step."""
    # Batches within MC2's default capacity (256 tokens per rank).
    spec = {"engine": dict(_engine(model), enforce_eager=True,
                           enable_expert_parallel=True,
                           max_num_batched_tokens=256),
            "k": 0, "per_layer": False, "prompts": PROMPTS[:2],
            "new_tokens": 6}
    return _run_dp(tree, spec, method, timeout, log)


def _run_dp(tree: Path, spec: dict[str, Any], method: str, timeout: int,
            log: Path) -> dict[str, Any]:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs, files, streams = [], [], []
    for rank in range(2):
        rank_spec = dict(spec, prompts=[spec["prompts"][rank]])
        with tempfile.NamedTemporaryFile("w", suffix=".json",
                                         delete=False) as f:
            json.dump(rank_spec, f)
        files.append(f.name)
        env = _env(tree, {
            "VLLM_DP_RANK": str(rank), "VLLM_DP_RANK_LOCAL": str(rank),
            "VLLM_DP_SIZE": "2", "VLLM_DP_MASTER_IP": "127.0.0.1",
            "VLLM_DP_MASTER_PORT": str(port),
            "VLLM_ASCEND_NPU_DOUBLE_SOC_VERSION": "250",
            "VLLM_ASCEND_MOE_COMM": method})
        out = tempfile.TemporaryFile("w+")  # noqa: SIM115
        err = tempfile.TemporaryFile("w+")  # noqa: SIM115
        streams.append((out, err))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tools.bench.step_cost", "--child",
             f.name], cwd=tree, env=env, stdout=out, stderr=err,
            start_new_session=True))
    try:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if (any(p.poll() not in (None, 0) for p in procs)
                    or time.monotonic() > deadline):
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
        for name in files:
            os.unlink(name)
    outs = []
    for out, err in streams:
        out.seek(0)
        err.seek(0)
        outs.append((out.read(), err.read()))
        out.close()
        err.close()
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("\n\n".join(o + "\n--- stderr ---\n" + e
                               for o, e in outs))
    if any(p.returncode for p in procs):
        raise RuntimeError(f"DP engines failed (log: {log}):\n"
                           f"{outs[0][1][-2000:]}\n{outs[1][1][-2000:]}")
    return _last_result(outs[0][0])


def _engine(model: Path) -> dict[str, Any]:
    return dict(model=str(model), skip_tokenizer_init=True,
                dtype="bfloat16", max_model_len=128, max_num_seqs=4,
                seed=0, kv_cache_memory_bytes=32 << 20,
                quantization="ascend",
                compilation_config={"cudagraph_capture_sizes":
                                    [1, 2, 4, 8, 12, 16]})


def measure(tree: Path, model: Path, bytes_model: Optional[Path],
            ks: list[int], timeout: int, logs: Path,
            emit: Callable[[str], None]) -> dict[str, Any]:
    """The raw results of one tree: per k, a graph-mode run and an eager
    (per-layer) run; per method, a DP pair."""
    runs: dict[str, Any] = {}
    for k in [0] + ks:
        # Per-layer kernels from eager runs without MTP and with the first
        # k (the layers do not change with k).
        for mode in ("graph", "eager") if k in ([0] + ks)[:2] else (
                "graph", ):
            engine = _engine(model)
            if mode == "eager":
                engine.update(enforce_eager=True,
                              compilation_config={"level": 0})
            spec = {"engine": engine, "k": k, "per_layer": mode == "eager",
                    "prompts": PROMPTS, "new_tokens": NEW_TOKENS}
            start = time.perf_counter()
            runs[f"k{k}.{mode}"] = run_child(tree, spec, timeout,
                                             logs / f"k{k}-{mode}.log")
            emit(f"  {tree.name}: k={k} {mode} "
                 f"({time.perf_counter() - start:.0f} s)")
    if bytes_model is not None:
        for method in METHODS:
            start = time.perf_counter()
            try:
                runs[f"bytes.{method}"] = run_bytes(
                    tree, bytes_model, method, timeout,
                    logs / f"bytes-{method}.log")
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                runs[f"bytes.{method}"] = {"error": str(e)[-500:]}
            emit(f"  {tree.name}: bytes {method} "
                 f"({time.perf_counter() - start:.0f} s)")
    return runs


# -- from raw runs to the report ------------------------------------------
def _mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def _scope(step: dict[str, Any], name: str) -> dict[str, Any]:
    return step.get(name) or {"kernels": 0, "syncs": [], "exchanges": [],
                              "calls": 0}


def summarize(runs: dict[str, Any], ks: list[int]) -> dict[str, Any]:
    """Figures (name -> number) and details (call sites, formats)."""
    figures: dict[str, float] = {}
    details: dict[str, Any] = {"sync_sites": {}, "weights": {},
                               "exchanges": {}}
    for k in [0] + ks:
        graph = runs[f"k{k}.graph"]
        eager = runs.get(f"k{k}.eager") or {"metered_steps": []}
        tag = f"k{k}"
        steps = graph["metered_steps"]
        if steps:
            fwd = _mean([_scope(s, "forward")["kernels"] for s in steps])
            figures[f"cost.{tag}.kernels.target_forward"] = fwd
            draft = _mean([_scope(s, "draft_forward")["kernels"]
                           for s in steps])
            step_total = _mean([
                sum(c["kernels"] for n, c in s.items()
                    if not n.startswith("layer.")) for s in steps])
            figures[f"cost.{tag}.kernels.step"] = step_total
            if k:
                figures[f"cost.{tag}.kernels.draft_forward"] = draft
            _syncs(figures, details, tag, steps, k)
        esteps = eager["metered_steps"]
        if esteps:
            layers: dict[str, list[int]] = {}
            for s in esteps:
                for name, c in s.items():
                    if name.startswith("layer.target."):
                        kind = name.rsplit(".", 1)[1]
                        layers.setdefault(kind, []).append(
                            c["kernels"] / max(c["calls"], 1))
            for kind, counts in layers.items():
                figures[f"cost.{tag}.kernels.{kind}_layer"] = max(counts)
            # The eager forward in all (outside the layers and in them):
            # equal to the replayed graph's.
            figures[f"cost.{tag}.kernels.target_forward_eager"] = _mean([
                sum(c["kernels"] for n, c in s.items()
                    if n == "forward" or n.startswith("layer.target."))
                for s in esteps])
        host = graph.get("host_s_per_step")
        if host is not None:
            figures[f"cost.{tag}.host_ms_per_step"] = 1000 * host
        details["weights"][tag] = graph["weights"]
    base = figures.get("cost.k0.host_ms_per_step")
    for k in ks:
        mtp = figures.get(f"cost.k{k}.host_ms_per_step")
        if base and mtp is not None:
            figures[f"cost.k{k}.host_mtp_over_no_mtp"] = mtp / base
            figures[f"cost.k{k}.host_added_over_no_mtp"] = (mtp - base) / base
    weights = runs["k0.graph"]["weights"]["target"]
    int8 = weights["int8"]
    total = sum(e["bytes"] for e in int8.values())
    if total:
        figures["cost.weights.int8_nz_fraction"] = (
            int8.get("FRACTAL_NZ", {}).get("bytes", 0) / total)
    for method in METHODS:
        run = runs.get(f"bytes.{method}")
        if not run or "error" in run:
            if run:
                details["exchanges"][method] = run
            continue
        _bytes(figures, details, method, run)
    return {"figures": figures, "details": details}


def _syncs(figures, details, tag, steps, k) -> None:
    """Syncs per step inside the device work: the target forward, the
    sampler, each draft step; the output read apart."""
    groups: dict[str, list[int]] = {}
    sites: dict[str, set[str]] = {}

    def add(group: str, syncs: list[dict[str, Any]], n_steps: int) -> None:
        groups.setdefault(group, []).append(len(syncs))
        sites.setdefault(group, set()).update(
            f"{s['kind']} @ {s['site']}" for s in syncs)

    for s in steps:
        add("forward", _scope(s, "forward")["syncs"], 1)
        add("sample", _scope(s, "sample")["syncs"], 1)
        add("output_read", _scope(s, "runner")["syncs"]
            + _scope(s, "output_read")["syncs"], 1)
        if k:
            draft = (_scope(s, "draft")["syncs"]
                     + _scope(s, "draft_forward")["syncs"])
            for i in range(1, k + 1):
                add(f"draft{i}", [d for d in draft
                                  if (d.get("tag") or "draft1")
                                  == f"draft{i}"], 1)
    step = "verify" if k else "decode"
    for group, counts in groups.items():
        name = {"forward": f"{step}_forward", "sample": f"{step}_sample"
                }.get(group, group)
        figures[f"cost.{tag}.syncs.{name}"] = max(counts)
        details["sync_sites"][f"{tag}.{name}"] = sorted(sites[group])


def _bytes(figures, details, method, run) -> None:
    """Payload bytes per token that rank 0 hands to the MoE exchanges of one
    MoE layer (the collectives and MC2 kernels called from the plugin's or
    vLLM's distributed/ code, all-reduces aside), per op and dtype."""
    per_op: dict[str, float] = {}
    steps = run["metered_steps"]
    for s in steps:
        tokens = s.get("_tokens", {}).get("tokens") or 1
        for e in _scope(s, "forward")["exchanges"]:
            if "distributed/" not in e["site"] or e["op"] == "hccl.allreduce":
                continue  # not the MoE exchange (a TP all-reduce)
            key = f"{e['op']}[{e['dtype']}]"
            per_op[key] = per_op.get(key, 0) + e["nbytes"] / tokens
    n = (len(steps) or 1) * run.get("moe_layers", 1)
    per_op = {key: value / n for key, value in per_op.items()}
    figures[f"cost.bytes.{method}.per_token"] = sum(per_op.values())
    details["exchanges"][method] = {
        "per_token_by_op": per_op,
        "sites": sorted({f"{e['op']} @ {e['site']}" for s in steps
                         for e in _scope(s, "forward")["exchanges"]})}


# -- output ------------------------------------------------------------------
def fmt(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.3g}"


def format_report(columns: dict[str, dict[str, Any]]) -> str:
    names = list(columns)
    figures = sorted({f for c in columns.values() for f in c["figures"]})
    width = max([len(f) for f in figures] + [20])
    head = f"{'figure':{width}} " + " ".join(f"{n[:14]:>14}" for n in names)
    if len(names) == 2:
        head += f" {'ratio':>8}"
    lines = [head]
    for f in figures:
        values = [columns[n]["figures"].get(f) for n in names]
        line = f"{f:{width}} " + " ".join(f"{fmt(v):>14}" for v in values)
        if len(values) == 2 and values[0] and values[1] is not None:
            line += f" {values[1] / values[0]:8.2f}"
        lines.append(line)
    for n in names:
        d = columns[n]["details"]
        lines.append(f"\n[{n}] host syncs by call site:")
        for group, sites in d["sync_sites"].items():
            for site in sites:
                lines.append(f"  {group:24} {site}")
        lines.append(f"[{n}] weight formats (target, k=0): "
                     + json.dumps({kind: d["weights"].get("k0", {})
                                   .get("target", {}).get(kind)
                                   for kind in ("int8", "float")}))
        for method, info in d["exchanges"].items():
            lines.append(f"[{n}] {method}: {json.dumps(info)[:300]}")
    return "\n".join(lines)


def _worktree(ref: str, tmp: Path) -> Path:
    """A detached worktree of ``ref`` sharing this venv (and vllm tree)."""
    path = tmp / "against"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), ref],
                   cwd=ROOT, check=True, capture_output=True)
    for link in (".venv", "vllm"):
        if (ROOT / link).exists() and not (path / link).exists():
            (path / link).symlink_to((ROOT / link).resolve())
    # Both columns are measured by this harness.
    shutil.copy(Path(__file__), path / "tools" / "bench" / "step_cost.py")
    if not (path / DOUBLE / "_cost.py").is_file():
        # An older tree: this checkout's meter and the emulator hook it
        # needs (the double's ops stay the tree's own).
        for name in ("_cost.py", "_emulator.py"):
            shutil.copy(ROOT / DOUBLE / name, path / DOUBLE / name)
    return path


def double_installed() -> bool:
    site = subprocess.run(
        [sys.executable, "-c", "import site; print(site.getsitepackages()"
         "[0])"], capture_output=True, text=True).stdout.strip()
    return (Path(site) / "vllm-ascend-npu-double.pth").is_file()


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.bench.step_cost",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--against", default="main",
                   help="git ref measured side by side in a temporary "
                   "worktree ('' for none; default main)")
    p.add_argument("--k", default="1,2,3",
                   help="MTP draft lengths besides no MTP (default 1,2,3)")
    p.add_argument("--no-bytes", action="store_true",
                   help="skip the DP engines that count MoE bytes")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="where the checkpoints are written (default: a "
                   "temporary folder)")
    p.add_argument("--timeout", type=int, default=600,
                   help="seconds per engine (default 600)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON (default benchmarks/results/step-cost-<time>"
                   ".json)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run(args: argparse.Namespace, emit: Callable[[str], None] = print
        ) -> dict[str, Any]:
    ks = [int(k) for k in args.k.split(",") if k.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="step-cost-"))
    models = args.model_dir or tmp / "models"
    out = args.out or (ROOT / "benchmarks" / "results" /
                       f"step-cost-{time.strftime('%Y%m%d-%H%M%S')}.json")
    logs = out.with_suffix(".logs")
    try:
        model = write_checkpoint(models / "glm45-w8a8", MODEL_SHAPE)
        bytes_model = None if args.no_bytes else write_checkpoint(
            models / "glm45-w8a8-h1024", BYTES_SHAPE)
        trees = {"this": ROOT}
        if args.against:
            trees = {args.against: _worktree(args.against, tmp), **trees}
        columns, raw = {}, {}
        for name, tree in trees.items():
            emit(f"measuring {name} ({tree})")
            raw[name] = measure(tree, model, bytes_model, ks, args.timeout,
                                logs / name.replace("/", "_"), emit)
            columns[name] = summarize(raw[name], ks)
    finally:
        if args.against and (tmp / "against").exists():
            subprocess.run(["git", "worktree", "remove", "--force",
                            str(tmp / "against")], cwd=ROOT,
                           capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    result = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "how": "kernels, syncs and host time per decode step from the "
              "engine in FULL_AND_PIECEWISE through the double; per-layer "
              "kernels from an eager (level 0) engine; MoE bytes from a DP "
              "2 + EP pair of eager engines (A3 emulated, hidden 1024)",
              "model_shape": MODEL_SHAPE, "ks": ks, "columns": columns,
              "raw": raw}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    emit(format_report(columns))
    emit(f"JSON: {out}")
    return result


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.child:
        child_main(args.child)
        return
    if not double_installed():
        raise SystemExit("tools.bench.step_cost: the torch_npu double is not "
                         "installed in this venv (make install)")
    run(args)


if __name__ == "__main__":
    main()
