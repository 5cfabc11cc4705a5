"""The MoE communication method of each step.

Chosen once per step, as vllm-ascend does, from what every rank knows the
same way (the configuration and the DP-synced token count), so that all
ranks, and the MTP draft after the target, use one method in a step:

- without expert parallelism: all-gather (with DP, vLLM's dispatch and
  combine; without, nothing to exchange);
- with expert parallelism: MC2 when the largest DP rank's batch fits its
  buffers (``VLLM_ASCEND_MC2_CAPACITY`` tokens per rank); above, per SoC as
  vllm-ascend v0.11.0 (``_select_moe_comm_method``; main's
  ``_select_a3_moe_comm_method``): all-to-all on an Atlas A3, all-gather
  on an A2 (and on the CPU reference device). In graph mode all-gather
  when MC2 would run its torch exchange on an NPU (the fused kernels do
  not take the configuration): HCCL's all-to-all is not shown to be
  captured, so the A3's all-to-all too only runs a step no rank can replay
  a graph for (a batch above the largest capture size; vllm-ascend's MC2
  capacity is that size, so its all-to-all steps are eager as well). The
  choice must be the same on every rank, and a rank may run a step eagerly
  while another replays a graph (FULL_DECODE_ONLY): so it follows the
  configuration and the DP-synced batch, not the step's graph mode.

``VLLM_ASCEND_MOE_COMM=allgather|alltoall|mc2`` forces one; a forced method
that cannot run in the configuration fails at startup (``check_config``).
"""

from typing import Optional

from vllm import forward_context
from vllm.config import CUDAGraphMode
from vllm.logger import init_logger

from vllm_ascend import envs
from vllm_ascend.distributed.moe_comm import mc2_kernels
from vllm_ascend.distributed.moe_comm.all_gather import AllGatherMoEComm
from vllm_ascend.distributed.moe_comm.all_to_all import AllToAllMoEComm
from vllm_ascend.distributed.moe_comm.base import ExpertsFn, MoECommMethod
from vllm_ascend.distributed.moe_comm.mc2 import MC2MoEComm

logger = init_logger(__name__)

MOE_COMM_ENV = envs.VLLM_ASCEND_MOE_COMM_ENV
MC2_CAPACITY_ENV = envs.VLLM_ASCEND_MC2_CAPACITY_ENV
DEFAULT_MC2_CAPACITY = envs.DEFAULT_MC2_CAPACITY
_CLASSES: dict[str, type[MoECommMethod]] = {
    "allgather": AllGatherMoEComm,
    "alltoall": AllToAllMoEComm,
    "mc2": MC2MoEComm,
}
METHODS = tuple(_CLASSES)

__all__ = ["ExpertsFn", "MoECommMethod", "begin_step", "check_config",
           "configure", "current"]


def _uses_ep(vllm_config) -> bool:
    p = vllm_config.parallel_config
    return (p.enable_expert_parallel
            and p.data_parallel_size * p.tensor_parallel_size > 1)


def _uses_graphs(vllm_config) -> bool:
    model_config = vllm_config.model_config
    mode = vllm_config.compilation_config.cudagraph_mode
    return (model_config is not None and not model_config.enforce_eager
            and mode is not None and mode != CUDAGraphMode.NONE)


def check_config(vllm_config) -> None:
    """A forced method that cannot run here fails at startup, in one
    line."""
    name = envs.VLLM_ASCEND_MOE_COMM
    capacity = envs.VLLM_ASCEND_MC2_CAPACITY
    if name is None or vllm_config.model_config is None:
        return
    if name not in METHODS:
        raise ValueError(f"{MOE_COMM_ENV}={name!r} is not a MoE "
                         f"communication method; use one of "
                         f"{', '.join(METHODS)} (or unset it).")
    if name == "allgather":
        return
    if not _uses_ep(vllm_config):
        raise ValueError(
            f"{MOE_COMM_ENV}={name} exchanges tokens between expert-parallel "
            "ranks: it needs --enable-expert-parallel with more than one "
            f"rank (DP x TP > 1); unset {MOE_COMM_ENV} or use allgather.")
    graphs = _uses_graphs(vllm_config)
    if graphs and not _CLASSES[name].graph_safe:
        raise ValueError(
            f"{MOE_COMM_ENV}={name} reads per-rank token counts on the "
            "host and cannot run in captured graphs (graph mode is the "
            f"default): add --enforce-eager, or use {MOE_COMM_ENV}=mc2.")
    tokens = vllm_config.scheduler_config.max_num_batched_tokens
    if name == "mc2" and tokens > capacity:
        raise ValueError(
            f"{MOE_COMM_ENV}=mc2 holds at most {MC2_CAPACITY_ENV}="
            f"{capacity} tokens per rank, below --max-num-batched-tokens "
            f"{tokens}: raise {MC2_CAPACITY_ENV} to {tokens} or lower "
            "--max-num-batched-tokens.")


def _largest_graph(vllm_config) -> Optional[int]:
    """The largest batch a captured graph runs: 0 without graphs, None when
    graphs are on but their sizes unknown (any batch may replay one)."""
    if not _uses_graphs(vllm_config):
        return 0
    sizes = getattr(vllm_config.compilation_config,
                    "cudagraph_capture_sizes", None)
    return max(sizes) if sizes else None


def select_method(*, expert_parallel: bool, family: Optional[str],
                  fits_mc2: bool, mc2_graph_safe: bool, graphs: bool,
                  in_graph_range: bool) -> tuple[str, str]:
    """(method, reason) for one step, when none is forced.

    ``family``: "A2", "A3" or None (the CPU reference device);
    ``mc2_graph_safe``: MC2 runs its fused kernels, which graphs capture;
    ``in_graph_range``: some rank may replay a captured graph for this
    batch (graph mode and a batch within the largest capture size)."""
    if not expert_parallel:
        return "allgather", "no expert parallelism"
    a3_all_to_all = family == "A3" and not fits_mc2 and not in_graph_range
    if a3_all_to_all:
        return "alltoall", ("expert parallelism on an Atlas A3, batch above "
                            "the MC2 capacity and every captured graph")
    if graphs and not mc2_graph_safe:
        return "allgather", ("expert parallelism in graph mode; MC2 without "
                             "its fused kernels would capture HCCL "
                             "all-to-all")
    if fits_mc2:
        return "mc2", "expert parallelism, batch within the MC2 capacity"
    return "allgather", "expert parallelism, batch above the MC2 capacity"


class _Selection:

    def __init__(self) -> None:
        self.expert_parallel = False
        self.graphs = False
        self.family: Optional[str] = None
        self.largest_graph: Optional[int] = 0
        self.forced: Optional[str] = None
        self.methods: dict[str, MoECommMethod] = {}
        self.step_method: Optional[MoECommMethod] = None
        self.logged: set[str] = set()

    def configure(self, vllm_config) -> None:
        self.expert_parallel = _uses_ep(vllm_config)
        self.forced = envs.VLLM_ASCEND_MOE_COMM
        capacity = envs.VLLM_ASCEND_MC2_CAPACITY
        kernels = (mc2_kernels.create(vllm_config, capacity)
                   if self.expert_parallel else None)
        self.methods = {
            "allgather": AllGatherMoEComm(),
            "alltoall": AllToAllMoEComm(),
            "mc2": MC2MoEComm(capacity, kernels),
        }
        self.step_method = None
        self.graphs = _uses_graphs(vllm_config)
        self.largest_graph = _largest_graph(vllm_config)
        self.family = (mc2_kernels.device_family()
                       if self.expert_parallel else None)
        mc2 = self.methods["mc2"]
        if (self.expert_parallel and self.forced is None and self.graphs
                and not mc2.graph_safe):
            logger.info("MoE communication: all-gather, not MC2, in graph "
                        "mode: without the fused kernels MC2 would capture "
                        "HCCL all-to-all, which no proven graph does.")
        if self.forced == "mc2" and self.graphs and not mc2.graph_safe:
            raise ValueError(
                f"{MOE_COMM_ENV}=mc2: the fused MC2 kernels do not take this "
                "configuration (the log line above says why), and the torch "
                "exchange (HCCL all_to_all_single) is not shown to run in "
                "captured graphs (graph mode is the default): add "
                f"--enforce-eager, or use {MOE_COMM_ENV}=allgather.")

    def choose(self, num_tokens: int) -> MoECommMethod:
        if not self.methods:
            self.methods = {"allgather": AllGatherMoEComm()}
        if self.forced is not None:
            name, reason = self.forced, MOE_COMM_ENV
        elif not self.expert_parallel:
            name, reason = "allgather", "no expert parallelism"
        else:
            mc2 = self.methods["mc2"]
            assert isinstance(mc2, MC2MoEComm)
            tokens = _max_tokens(num_tokens)
            name, reason = select_method(
                expert_parallel=True,
                family=self.family,
                fits_mc2=tokens <= mc2.capacity,
                mc2_graph_safe=mc2.graph_safe,
                graphs=self.graphs,
                in_graph_range=self.graphs
                and (self.largest_graph is None
                     or tokens <= self.largest_graph))
        if name not in self.logged:
            self.logged.add(name)
            logger.info("MoE communication: %s (%s)", name, reason)
        return self.methods[name]


def _max_tokens(num_tokens: int) -> int:
    """The largest batch over DP ranks (the same on every rank)."""
    context = forward_context._forward_context
    if context is not None and context.dp_metadata is not None:
        return int(context.dp_metadata.max_tokens_across_dp_cpu)
    return num_tokens


_selection = _Selection()


def configure(vllm_config) -> None:
    """Called once per worker, before the model runs."""
    _selection.configure(vllm_config)


def begin_step() -> None:
    """A new step: the next MoE layer chooses the method for all."""
    _selection.step_method = None


def current(num_tokens: int) -> MoECommMethod:
    """The step's method (chosen at its first MoE layer, from the DP-synced
    batch size when there is one, else ``num_tokens``)."""
    if _selection.step_method is None:
        _selection.step_method = _selection.choose(num_tokens)
    return _selection.step_method
