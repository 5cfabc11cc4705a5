"""Run one vLLM engine in a fresh process and print its outputs as JSON.

Usage: ``python run_engine.py SPEC.json``. The spec holds ``engine`` (LLM
keyword arguments), ``prompts`` (token id lists) and ``sampling``
(SamplingParams keyword arguments, or a list of them, one per prompt). The
last stdout line is ``{"outputs": [[ids...], ...], "metrics": {...}}``.
A fresh process per engine keeps each configuration's distributed state and
memory apart.
"""

import json
import sys


def main(spec_path: str) -> None:
    from vllm import LLM, SamplingParams

    spec = json.loads(open(spec_path).read())
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
    print(json.dumps({
        "outputs": [list(o.outputs[0].token_ids) for o in outputs],
        "metrics": metrics,
    }))


if __name__ == "__main__":
    main(sys.argv[1])
