"""Run one vLLM engine in a fresh process and print its outputs as JSON.

Usage: ``python run_engine.py SPEC.json``. The spec holds ``engine`` (LLM
keyword arguments), ``prompts`` (token id lists) and ``sampling``
(SamplingParams keyword arguments, or a list of them, one per prompt) and
optionally ``setup`` ("module:function" run first). The
last stdout line is ``{"outputs": [[ids...], ...], "metrics": {...}}``.
A fresh process per engine keeps each configuration's distributed state and
memory apart.
"""

import json
import sys


def inspect_runner(worker) -> dict:
    """What the KV-cache and weight-sharing tests check, read in the worker."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    from vllm_ascend.compilation.graph_wrapper import graph_stats
    runner = worker.model_runner
    groups = [list(g.layer_names)
              for g in runner.kv_cache_config.kv_cache_groups]
    compilation = runner.compilation_config
    info = {
        "device": str(runner.device),
        "capture_sizes": compilation.cudagraph_capture_sizes,
        "compilation_level": int(compilation.level),
        "cudagraph_mode": compilation.cudagraph_mode.name,
        "graphs": graph_stats.as_dict(),
        "use_inductor": compilation.use_inductor,
        "custom_rms_norm": RMSNorm.enabled(),
        "async_scheduling": runner.scheduler_config.async_scheduling,
        "kv_cache_groups": groups,
        "num_block_tables": len(runner.input_batch.block_table.block_tables),
        "kv_cache_num_blocks": {
            name: int(layer.kv_cache[0].shape[1])
            for name, layer in
            runner.compilation_config.static_forward_context.items()
            if hasattr(layer, "kv_cache")
        },
    }
    info["param_sums"] = param_sums(runner.model)
    info["int8_formats"] = int8_formats(runner.model)
    drafter = getattr(runner, "drafter", None)
    if drafter is not None:
        info["draft_param_sums"] = param_sums(drafter.model)
        target, draft = runner.model, drafter.model
        vocab = runner.model_config.get_vocab_size()
        target_ptrs = {p.data_ptr() for p in target.parameters()}
        info.update(
            draft_attn_layers=list(drafter.attn_layer_names),
            # Vocab-sized tensors the draft allocated itself (the target's
            # modules it points at are not its own).
            draft_own_vocab_params=[
                name for name, p in draft.named_parameters()
                if vocab in p.shape and p.data_ptr() not in target_ptrs
            ],
            draft_embed_ptr=draft.model.embed_tokens.weight.data_ptr(),
            target_embed_ptr=target.model.embed_tokens.weight.data_ptr(),
            # The heads the MTP layers compute their logits with.
            draft_lm_head_ptrs=sorted({
                layer.shared_head.head.weight.data_ptr()
                for layer in draft.model.layers.values()
            }),
            target_lm_head_ptr=target.lm_head.weight.data_ptr(),
            drafter_class=type(drafter).__name__,
        )
    return info


def int8_formats(model) -> dict:
    """name -> the device format (an aclFormat) of each int8 parameter."""
    import torch

    from vllm_ascend.ops import weight_format
    return {
        name: weight_format.format_of(p)
        for name, p in model.named_parameters() if p.dtype == torch.int8
    }


def param_sums(model) -> dict:
    """name -> [numel, float64 sum, dtype] of each parameter as served."""
    return {
        name: [p.numel(), p.detach().double().sum().item(), str(p.dtype)]
        for name, p in model.named_parameters()
    }


def main(spec_path: str) -> None:
    from vllm import LLM, SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("setup"):
        # "module:function", called before the engine starts (the engine
        # core runs in this process): a test's deliberate mutation.
        import importlib
        module, function = spec["setup"].split(":")
        getattr(importlib.import_module(module), function)()
    llm = LLM(**spec["engine"], disable_log_stats=False)
    sampling = spec["sampling"]
    if isinstance(sampling, list):
        params = [SamplingParams(**s, detokenize=False) for s in sampling]
    else:
        params = SamplingParams(**sampling, detokenize=False)
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    metrics: dict = {}
    for metric in llm.get_metrics():
        if metric.name.startswith(("vllm:spec_decode", "vllm:num_preemptions",
                                   "vllm:prefix_cache")):
            value = getattr(metric, "values", None)
            if value is None:
                value = metric.value
            metrics[metric.name] = value
    result = {
        "outputs": [list(o.outputs[0].token_ids) for o in outputs],
        "metrics": metrics,
    }
    if any(o.prompt_logprobs for o in outputs):
        result["prompt_logprobs"] = [[
            None if position is None else
            {str(token): lp.logprob
             for token, lp in position.items()}
            for position in o.prompt_logprobs
        ] for o in outputs]
    if any(o.outputs[0].logprobs for o in outputs):
        result["logprobs"] = [[{
            str(token): lp.logprob
            for token, lp in position.items()
        } for position in o.outputs[0].logprobs] for o in outputs]
    if spec.get("inspect"):
        result["inspect"] = llm.collective_rpc(inspect_runner)[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
