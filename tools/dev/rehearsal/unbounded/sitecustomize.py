"""The rehearsal's ``mtp-unbounded`` run: the plugin without its guards on
the NPU's graph resources (capture sizes not bounded by the NPU's streams,
graph outputs held strongly), to show that the double refuses it at capture
with the NPU's error. On PYTHONPATH of that run only."""

import vllm_ascend.compilation.graph_mode as graph_mode
import vllm_ascend.compilation.graph_wrapper as graph_wrapper

graph_mode._bound_by_streams = lambda config, sizes, k: sizes
graph_wrapper.weak_output = lambda graph, output: output
