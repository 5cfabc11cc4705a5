"""The nightly's figures: one flat ``name -> number`` dict per run.

Names say what a figure is and where it was measured, e.g.
``speed.FULL_AND_PIECEWISE.b16.k1.mtp_over_no_mtp``. Booleans are 1 / 0 so
that every figure compares the same way and plots.
"""

from typing import Any, Optional

from tools.bench.graph_modes import find_batch, rows

MiB = 1 << 20
# Per (mode, batch, k) row of the graph-mode benchmark.
SPEED = ("tokens_per_s", "host_ms_per_step", "draft_over_target",
         "mtp_over_no_mtp", "graph_over_eager")


def _by_k(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {c["num_speculative_tokens"]: c for c in result["configs"]}


def first_divergence(got: list[int], want: list[int]) -> Optional[int]:
    """Index of the first token that differs (or where one output ends)."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def accuracy(outputs: list[list[int]],
             reference: list[list[int]]) -> dict[str, Any]:
    """Prompts whose greedy tokens equal the reference's; where the others
    first differ."""
    pairs = list(zip(outputs, reference))
    diverged = {}
    for i, (got, want) in enumerate(pairs):
        at = first_divergence(got, want)
        if at is not None:
            diverged[i] = {"token": at, "got": got[at:at + 3],
                           "want": want[at:at + 3]}
    return {"prompts": len(pairs),
            "equal": len(pairs) - len(diverged),
            "first_divergence": diverged}


def collect(runs: dict[str, dict[str, Any]],
            reference: Optional[dict[int, dict[str, Any]]],
            accuracy_batch: int) -> tuple[dict[str, float], dict[str, Any]]:
    """Figures and details from the benchmark result of each graph mode and
    the offline reference's result per k (None: no reference)."""
    figures: dict[str, float] = {}
    details: dict[str, Any] = {"accuracy": {}}
    k_of = {c["name"]: c["num_speculative_tokens"]
            for result in runs.values() for c in result["configs"]}
    for row in rows(runs):
        where = f"{row['mode']}.b{row['batch_size']}.k{k_of[row['config']]}"
        for key in SPEED:
            if row[key] is not None:
                figures[f"speed.{where}.{key}"] = row[key]
    ref_outputs = reference[min(reference)]["outputs"] if reference else None
    for mode, result in runs.items():
        configs = _by_k(result)
        no_mtp = configs.get(0)
        captured = sum(c["graphs"]["captured"] for c in configs.values())
        replayed = sum(c["graphs"]["replayed"] for c in configs.values())
        if mode != "eager":
            figures[f"invariant.{mode}.graphs_captured"] = int(captured > 0)
            figures[f"invariant.{mode}.graphs_replayed"] = int(replayed > 0)
        for k, config in configs.items():
            tag = f"{mode}.k{k}"
            for b in config["batches"]:
                base = find_batch(no_mtp, b["batch_size"])
                if k and base:
                    figures[f"accuracy.{mode}.b{b['batch_size']}.k{k}."
                            "equal_to_no_mtp"] = int(
                                b["outputs_sha1"] == base["outputs_sha1"])
            big = find_batch(config, accuracy_batch)
            if big and ref_outputs is not None and "outputs" in big:
                acc = accuracy(big["outputs"], ref_outputs)
                details["accuracy"][tag] = acc
                figures[f"accuracy.{tag}.prompts_equal"] = acc["equal"]
            if k and big and big.get("acceptance"):
                _acceptance(figures, tag, big["acceptance"],
                            (reference or {}).get(k))
            if k and (config.get("watchdog") or {}).get(
                    "num_pauses") is not None:
                # The speculation watchdog never pauses the trained head.
                figures[f"watchdog.{tag}.pauses"] = config["watchdog"][
                    "num_pauses"]
            if k:
                shares = set(config.get("draft_shares") or ())
                figures[f"invariant.{tag}.draft_shares_embed_and_head"] = int(
                    shares >= {"embed_tokens", "lm_head"})
            memory = config["memory"]
            figures[f"memory.{tag}.weights_mib"] = memory["weights_bytes"] / MiB
            figures[f"memory.{tag}.peak_rss_mib"] = (
                memory["peak_rss_bytes"] / MiB)
            if memory.get("kv_cache_bytes_configured"):
                figures[f"memory.{tag}.kv_cache_mib"] = (
                    memory["kv_cache_bytes_configured"] / MiB)
            if k:
                figures[f"memory.{tag}.draft_owned_mib"] = (
                    memory["drafter_weights_bytes"] / MiB)
    return figures, details


def _acceptance(figures: dict[str, float], tag: str, got: dict[str, Any],
                ref: Optional[dict[str, Any]]) -> None:
    """vLLM-reported acceptance in percent, per position, and its distance
    from the offline reference in points."""
    if got.get("acceptance_rate") is None:
        return
    figures[f"acceptance.{tag}.rate"] = 100 * got["acceptance_rate"]
    for j, rate in enumerate(got.get("acceptance_rate_per_pos") or []):
        figures[f"acceptance.{tag}.pos{j + 1}"] = 100 * rate
    if ref is not None:
        figures[f"acceptance.{tag}.reference_rate"] = (
            100 * ref["acceptance_rate"])
        figures[f"acceptance.{tag}.minus_reference"] = (
            100 * (got["acceptance_rate"] - ref["acceptance_rate"]))


def collapsed(result: dict[str, Any]) -> dict[str, float]:
    """Figures of the collapsed-MTP-layer run (no MTP, then MTP with the
    watchdog on and a collapsed MTP layer): the watchdog's pauses, and
    tokens/s over no MTP per batch size (it must stay near 1)."""
    figures: dict[str, float] = {}
    for config in result["configs"]:
        k = config["num_speculative_tokens"]
        if not k:
            continue
        pauses = (config.get("watchdog") or {}).get("num_pauses")
        if pauses is not None:
            figures[f"watchdog.collapsed.k{k}.pauses"] = pauses
    for row in result.get("comparison", []):
        figures[f"speed.collapsed.b{row['batch_size']}.k1.mtp_over_no_mtp"] = (
            row["speedup"])
    return figures
