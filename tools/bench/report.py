"""The benchmark's report: ratio table, output identity, JSON and PNG."""

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

MiB = 1 << 20


def config_name(k: int) -> str:
    return f"mtp_k{k}" if k else "no_mtp"


def outputs_digest(outputs: list[list[int]]) -> str:
    return hashlib.sha1(json.dumps(outputs).encode()).hexdigest()


def compare(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per MTP config and batch size: tokens/s ratio over no MTP and whether
    the greedy outputs are token-identical. Needs the ``outputs`` of each
    batch (dropped from the JSON afterwards)."""
    base = next((c for c in configs if c["num_speculative_tokens"] == 0),
                None)
    if base is None:
        return []
    base_by_batch = {b["batch_size"]: b for b in base["batches"]}
    rows = []
    for cfg in configs:
        if cfg is base:
            continue
        for b in cfg["batches"]:
            ref = base_by_batch.get(b["batch_size"])
            if ref is None:
                continue
            rows.append({
                "config": cfg["name"],
                "batch_size": b["batch_size"],
                "speedup": b["decode_tokens_per_s"] /
                ref["decode_tokens_per_s"],
                "speedup_best": b["best_decode_tokens_per_s"] /
                ref["best_decode_tokens_per_s"],
                "speedup_cpu": b["decode_tokens_per_cpu_s"] /
                ref["decode_tokens_per_cpu_s"],
                "outputs_identical": b["outputs"] == ref["outputs"],
            })
    return rows


def fmt(value: Optional[float], spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def format_table(results: dict[str, Any]) -> str:
    """Decode tokens/s per config and batch size (median, wall clock), the
    MTP/no-MTP ratios side by side (wall clock, and per CPU second of the
    engine process, which a busy host inflates less), acceptance, identity,
    then memory per config. A run with the speculation watchdog's
    configurations (``results["watchdog"]``, ``tools.bench.mtp
    --watchdog``) or an adaptive draft length's (``results["adaptive"]``,
    ``--adaptive``) puts only the ratios side by side, then a row per MTP
    config and batch with the watchdog's pauses (``format_side_by_side``).
    """
    if results.get("watchdog") or results.get("adaptive"):
        return format_side_by_side(results)
    lines = [_ratio_table(results), "", _detail_table(results), "",
             _memory_table(results), "", _identity_line(results)]
    note = _unplanned_pauses(results)
    if note:
        lines.append(note)
    return "\n".join(lines)


def _ratio_table(results: dict[str, Any]) -> str:
    configs = results["configs"]
    ratio = {(r["config"], r["batch_size"]): r
             for r in results["comparison"]}
    header = ["batch"] + [f"{c['name']} tok/s" for c in configs]
    mtp = [c for c in configs if c["num_speculative_tokens"]]
    for c in mtp:
        header += [f"{c['name']} ratio", f"{c['name']} cpu ratio",
                   f"{c['name']} acc",
                   f"{c['name']} len", f"{c['name']} same"]
    rows = []
    for i, batch in enumerate(results["settings"]["batch_sizes"]):
        row = [str(batch)]
        row += [fmt(c["batches"][i]["decode_tokens_per_s"], ".1f")
                for c in configs]
        for c in mtp:
            acc = c["batches"][i].get("acceptance") or {}
            cmp = ratio.get((c["name"], batch))
            row += [
                fmt(cmp and cmp["speedup"], ".2f") + ("x" if cmp else ""),
                fmt(cmp and cmp["speedup_cpu"], ".2f") + ("x" if cmp else ""),
                fmt(acc.get("acceptance_rate"), ".1%"),
                fmt(acc.get("mean_acceptance_length"), ".2f"),
                "-" if cmp is None else
                ("yes" if cmp["outputs_identical"] else "NO"),
            ]
        rows.append(row)
    return grid(header, rows)


def _detail_table(results: dict[str, Any]) -> str:
    detail_header = ["config", "batch", "median tok/s", "best tok/s",
                     "tok/CPU-s", "vLLM-timed tok/s", "T_N s", "T_1 s"]
    detail = [[c["name"], str(b["batch_size"]),
               fmt(b["decode_tokens_per_s"], ".1f"),
               fmt(b["best_decode_tokens_per_s"], ".1f"),
               fmt(b["decode_tokens_per_cpu_s"], ".1f"),
               fmt(b.get("vllm_decode_tokens_per_s"), ".1f"),
               fmt(b["median_t_full_s"], ".3f"),
               fmt(b["median_t_one_s"], ".3f")]
              for c in results["configs"] for b in c["batches"]]
    return grid(detail_header, detail)


def _memory_table(results: dict[str, Any]) -> str:
    mem_header = ["config", "peak RSS MiB", "weights MiB", "drafter MiB",
                  "KV cache MiB", "init s"]
    mem_rows = []
    for c in results["configs"]:
        m = c["memory"]
        kv = m.get("kv_cache_bytes_configured")
        mem_rows.append([
            c["name"], f"{m['peak_rss_bytes'] / MiB:.0f}",
            f"{m['weights_bytes'] / MiB:.2f}",
            f"{m['drafter_weights_bytes'] / MiB:.2f}",
            "-" if kv is None else f"{kv / MiB:.0f}", f"{c['init_s']:.1f}"
        ])
    return grid(mem_header, mem_rows)


def _identity_line(results: dict[str, Any]) -> str:
    identical = results["outputs_identical"]
    return ("greedy outputs with MTP identical to without: " +
            {True: "yes", False: "NO (see comparison)",
             None: "not checked (no pair of configs)"}[identical])


def _pauses(batch: dict[str, Any]) -> Optional[int]:
    return (batch.get("watchdog") or {}).get("num_pauses")


def _unplanned_pauses(results: dict[str, Any]) -> Optional[str]:
    """A note when vLLM's speculation watchdog, left at its defaults in a
    config, paused speculation there: that config's figures then mix steps
    with and without drafts (they do not on a healthy draft, whose
    acceptance is far above the watchdog's floor)."""
    paused = []
    for c in results["configs"]:
        extra = c.get("speculative_config") or {}
        # Not the watchdog comparison's configs, nor an adaptive draft
        # length (whose steps differ by design): their tables show pauses.
        if not c["num_speculative_tokens"] or extra.get(
                "adaptive_draft_length") or any(
                    key.startswith("fallback_") for key in extra):
            continue
        at = [str(b["batch_size"]) for b in c["batches"] if _pauses(b)]
        if at:
            paused.append(f"{c['name']} (batch {', '.join(at)})")
    if not paused:
        return None
    return ("note: vLLM's speculation watchdog (on by default) paused "
            "speculation in " + "; ".join(paused) + ": those MTP figures "
            "mix steps with and without drafts; compare the watchdog off "
            "and on with --watchdog (benchmarks/README.md)")


def short_label(name: str) -> str:
    """``mtp_k1+wd_collapsed`` -> ``k=1+wd collapsed``."""
    if name.startswith("mtp_k"):
        name = "k=" + name[len("mtp_k"):]
    return name.replace("_", " ")


def adaptive_vs_best(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per adaptive config (``results["adaptive"]["configs"]``) and batch
    size: its tokens/s over the fastest of the configs it is compared with
    (no MTP and the fixed k's of its layer, ``best_of``), by wall clock
    and by CPU time (each its own fastest), and whether it reaches the
    goal (``results["adaptive"]["goal"]``, by wall clock)."""
    info = results["adaptive"]
    by_name = {c["name"]: c for c in results["configs"]}
    rows = []
    for name, spec in info["configs"].items():
        config = by_name.get(name)
        rivals = [by_name[n] for n in spec["best_of"] if n in by_name]
        if config is None or not rivals:
            continue
        for b in config["batches"]:
            best, best_tps = _fastest(rivals, b["batch_size"],
                                      "decode_tokens_per_s")
            best_cpu, best_cpu_tps = _fastest(rivals, b["batch_size"],
                                              "decode_tokens_per_cpu_s")
            ratio = b["decode_tokens_per_s"] / best_tps
            rows.append({
                "config": name, "batch_size": b["batch_size"],
                "best": best, "best_tokens_per_s": best_tps,
                "tokens_per_s": b["decode_tokens_per_s"], "ratio": ratio,
                "best_cpu": best_cpu,
                "ratio_cpu": b["decode_tokens_per_cpu_s"] / best_cpu_tps,
                "meets_goal": ratio >= info["goal"],
            })
    return rows


def _fastest(configs: list[dict[str, Any]], batch: int,
             key: str) -> tuple[str, float]:
    """The name and ``key`` of the config with the highest ``key`` at
    ``batch``."""
    values = [(b[key], c["name"]) for c in configs for b in c["batches"]
              if b["batch_size"] == batch]
    value, name = max(values)
    return name, value


def format_adaptive_tables(results: dict[str, Any]) -> list[str]:
    """Lines of an adaptive draft length's run: per adaptive config and
    batch, its tokens/s over the best fixed config's; then its decode steps
    per draft length and what the policy measured."""
    info = results["adaptive"]
    rows = info.get("vs_best") or adaptive_vs_best(results)
    goal = info["goal"]
    header = ["config", "batch", "best", "best tok/s", "tok/s",
              "adaptive / best", "best (CPU)", "adaptive / best (CPU)",
              f">= {goal:.2f}"]
    table = [[short_label(r["config"]), str(r["batch_size"]),
              short_label(r["best"]), fmt(r["best_tokens_per_s"], ".1f"),
              fmt(r["tokens_per_s"], ".1f"), f"{r['ratio']:.3f}x",
              short_label(r["best_cpu"]), f"{r['ratio_cpu']:.3f}x",
              "yes" if r["meets_goal"] else "NO"] for r in rows]
    lines = [f"adaptive / best: tokens/s over the fastest of no MTP and "
             f"the fixed k's of the same layer (goal >= {goal:.2f}):",
             grid(header, table), ""]
    k = info["k"]
    slash = "/".join(str(i) for i in range(k + 1))
    choice_header = ["config", "batch", "decode steps",
                     f"steps at k={slash}", "draft tok/draft",
                     f"step ms k={slash}", "samples",
                     "acc | prev per pos", "E[tokens] k=" + slash]
    choices = []
    by_name = {c["name"]: c for c in results["configs"]}
    for name in info["configs"]:
        for b in (by_name.get(name) or {}).get("batches", []):
            d = b.get("draft_length")
            if not d:
                continue
            acc = b.get("acceptance") or {}
            drafts = acc.get("num_drafts")
            steps = d["steps_per_length"]
            choices.append([
                short_label(name), str(b["batch_size"]), str(sum(steps)),
                "/".join(map(str, steps)),
                fmt(acc["num_draft_tokens"] / drafts if drafts else None,
                    ".2f"),
                "/".join(fmt(t, ".1f") for t in d["step_ms"]),
                "/".join(map(str, d["step_samples"])),
                "/".join(fmt(a, ".2f") for a in d["acceptance_per_pos"]),
                "/".join(fmt(e, ".2f") for e in d["expected_tokens"]),
            ])
    if choices:
        lines += ["adaptive draft length: decode steps of the timed runs "
                  "per draft length, and the policy's measurements at the "
                  "end of the batch (its bucket's step time per length, "
                  "acceptance per position given the one before, expected "
                  "tokens per request of a step):",
                  grid(choice_header, choices), ""]
    return lines


def format_side_by_side(results: dict[str, Any]) -> str:
    """A comparison of the speculation watchdog's configs and/or of an
    adaptive draft length's: per batch size, the tokens/s of no MTP and
    every MTP config's ratio over it side by side (wall clock / CPU time);
    per MTP config and batch, acceptance, drafts, draft tokens per draft,
    the watchdog's pauses and whether it is paused; with an adaptive
    config, its tokens/s over the best fixed config's and its choices;
    then the detail, memory and identity as in ``format_table``, and what
    each config was."""
    configs = results["configs"]
    base = next((c for c in configs if not c["num_speculative_tokens"]),
                None)
    mtp = [c for c in configs if c["num_speculative_tokens"]]
    ratio = {(r["config"], r["batch_size"]): r
             for r in results["comparison"]}

    def cell(name: str, batch: int) -> str:
        r = ratio.get((name, batch))
        if r is None:
            return "-"
        return f"{r['speedup']:.2f}x / {r['speedup_cpu']:.2f}x"

    header = ["batch"] + ([f"{base['name']} tok/s"] if base else []) + [
        short_label(c["name"]) for c in mtp
    ]
    rows = []
    for i, batch in enumerate(results["settings"]["batch_sizes"]):
        row = [str(batch)]
        if base:
            row.append(fmt(base["batches"][i]["decode_tokens_per_s"], ".1f"))
        row += [cell(c["name"], batch) for c in mtp]
        rows.append(row)
    lines = ["decode tokens/s over no MTP (wall clock / CPU time):",
             grid(header, rows), ""]
    per_header = ["config", "batch", "tok/s", "ratio", "cpu ratio", "acc",
                  "len", "drafts", "tok/draft", "pauses", "paused", "same"]
    per = []
    for c in mtp:
        for b in c["batches"]:
            acc = b.get("acceptance") or {}
            wd = b.get("watchdog") or {}
            cmp = ratio.get((c["name"], b["batch_size"]))
            paused = wd.get("paused")
            per.append([
                short_label(c["name"]), str(b["batch_size"]),
                fmt(b["decode_tokens_per_s"], ".1f"),
                fmt(cmp and cmp["speedup"], ".2f") + ("x" if cmp else ""),
                fmt(cmp and cmp["speedup_cpu"], ".2f") + ("x" if cmp else ""),
                fmt(acc.get("acceptance_rate"), ".1%"),
                fmt(acc.get("mean_acceptance_length"), ".2f"),
                fmt(acc.get("num_drafts"), ".0f"),
                fmt(acc["num_draft_tokens"] / acc["num_drafts"]
                    if acc.get("num_drafts") else None, ".2f"),
                fmt(wd.get("num_pauses"), ".0f"),
                "-" if paused is None else ("yes" if paused else "no"),
                "-" if cmp is None else
                ("yes" if cmp["outputs_identical"] else "NO"),
            ])
    lines += [grid(per_header, per), ""]
    if results.get("adaptive"):
        lines += format_adaptive_tables(results)
    lines += [_detail_table(results), "", _memory_table(results), "",
              _identity_line(results)]
    if results.get("watchdog"):
        lines += watchdog_notes(results)
    if results.get("adaptive"):
        lines += adaptive_notes(results)
    note = _unplanned_pauses(results)
    if note:
        lines.append(note)
    return "\n".join(lines)


def adaptive_notes(results: dict[str, Any]) -> list[str]:
    """What the adaptive comparison's configs were."""
    info = results["adaptive"]
    lines = []
    if not results.get("watchdog"):
        lines.append("k=K: fixed k, the engine's own speculative config "
                     "(the watchdog on at vLLM's defaults), as in the "
                     "default run.")
    lines.append(f"adaptive: num_speculative_tokens {info['k']} (max of "
                 "--k) with adaptive_draft_length true: each step the "
                 "scheduler drafts 0..k tokens, the k maximizing expected "
                 "tokens/s from measured acceptance and step time; the "
                 "watchdog at vLLM's defaults.")
    for name, spec in info["configs"].items():
        lines.append(f"{short_label(name)} / best: over the fastest of " +
                     ", ".join(short_label(n) for n in spec["best_of"]) +
                     (f" ({spec['setup']} called in the engine)"
                      if spec.get("setup") else "") + ".")
    lines.append("tok/draft: draft tokens per draft verified (requests "
                 "drafting 0 tokens make no draft).")
    return lines


def watchdog_notes(results: dict[str, Any]) -> list[str]:
    """What the watchdog comparison's configs were, from what each engine
    resolved."""
    info = results["watchdog"]
    on = next((c for c in results["configs"]
               if "+wd" in c["name"]), None)
    settings = ((on or {}).get("watchdog") or {}).get("settings") or {}
    resolved = ", ".join(f"{key} {value}"
                         for key, value in settings.items()
                         if key != "fallback_window")
    lines = [
        "k=K: fallback_acceptance_floor 0, the watchdog off: a draft at "
        "every step (fixed k).",
        "k=K+wd: the watchdog on, " +
        (f"{resolved} as the engine resolved them"
         if resolved else "its settings not reported") +
        (f" (with {json.dumps(info['extra'])} from --watchdog-config)"
         if info.get("extra") else " (vLLM's defaults)") +
        f", and fallback_window {info['fallback_window']} "
        f"(--fallback-window; vLLM's default is {info['default_window']} "
        "drafts, more than these short runs make).",
    ]
    if info.get("collapsed"):
        lines.append(f"collapsed: {info['collapsed']} called in the MTP "
                     "engines before they start (the no-MTP engine is "
                     "unaffected): the draft's acceptance is near 0.")
    lines.append("drafts: drafts verified in the timed runs; pauses: times "
                 "the watchdog paused speculation from the warm-up to the end "
                 "of that batch's timed runs (vllm:spec_decode_num_pauses); "
                 "paused: vllm:spec_decode_paused at the end of them.")
    return lines


def grid(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header] + rows)
              for i in range(len(header))]
    row = " | ".join(f"{{:>{w}}}" for w in widths)
    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([row.format(*header), sep] +
                     [row.format(*r) for r in rows])


def write_json(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")


def write_plot(results: dict[str, Any], path: Path) -> None:
    """Decode tokens/s against batch size per config, and the acceptance
    rate (with mean acceptance length) of each MTP config."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = results["configs"]
    batches = results["settings"]["batch_sizes"]
    fig, (ax_tps, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {c["name"]: f"C{i}" for i, c in enumerate(configs)}
    for c in configs:
        ax_tps.plot(batches,
                    [b["decode_tokens_per_s"] for b in c["batches"]],
                    marker="o", label=c["name"], color=colors[c["name"]])
    ax_tps.set_xscale("log", base=2)
    ax_tps.set_xticks(batches, [str(b) for b in batches])
    ax_tps.set_xlabel("batch size")
    ax_tps.set_ylabel("decode tokens/s (median)")
    ax_tps.set_title("Decode throughput")
    ax_tps.grid(alpha=0.3)
    ax_tps.legend()
    mtp = [c for c in configs if c["num_speculative_tokens"]]
    width = 0.8 / max(len(mtp), 1)
    for j, c in enumerate(mtp):
        rates = [(b.get("acceptance") or {}).get("acceptance_rate") or 0.0
                 for b in c["batches"]]
        xs = [i + (j - (len(mtp) - 1) / 2) * width
              for i in range(len(batches))]
        bars = ax_acc.bar(xs, rates, width, label=c["name"],
                          color=colors[c["name"]])
        for bar, b in zip(bars, c["batches"]):
            length = (b.get("acceptance") or {}).get(
                "mean_acceptance_length")
            if length is not None:
                # Mean acceptance length, written up the bar.
                ax_acc.annotate(f"len {length:.2f}",
                                (bar.get_x() + bar.get_width() / 2, 0.02),
                                ha="center", va="bottom", rotation=90,
                                fontsize=8)
    ax_acc.set_xticks(range(len(batches)), [str(b) for b in batches])
    ax_acc.set_ylim(0, 1.25)
    ax_acc.set_xlabel("batch size")
    ax_acc.set_ylabel("acceptance rate (accepted / draft tokens)")
    ax_acc.set_title("MTP acceptance" if mtp else "MTP acceptance (no MTP "
                     "config)")
    if mtp:
        ax_acc.legend(loc="upper right", fontsize=8)
    settings = results["settings"]
    fig.suptitle(f"{Path(settings['model']).name}, {settings['device']}, "
                 f"{settings['new_tokens']} new tokens, "
                 f"median of {settings['repeats']}  ({results['created']})",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
