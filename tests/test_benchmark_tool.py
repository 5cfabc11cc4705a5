"""The MTP benchmark (``tools.bench.run``, ``python -m tools.bench.mtp``):
its arithmetic, its input checks, and one small end-to-end run (batch 1,
4 new tokens, 1 repeat) on a random tiny GLM-4.5 checked for schema and
internal consistency. No timing thresholds."""

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.utils.checkpoints import write_random_glm45
from tools.bench import mtp as mtp_cli
from tools.bench import report
from tools.bench import run as bench
from tools.bench import stats

# -- arithmetic ------------------------------------------------------------


def test_decode_tokens_per_s_subtracts_the_one_token_run():
    # 4 requests x 9 decode tokens in 3 s (5 s - 2 s).
    assert stats.decode_tokens_per_s(5.0, 2.0, 4, 10) == pytest.approx(12.0)


@pytest.mark.parametrize("t_full,t_one,n,match", [
    (1.0, 1.5, 10, "not slower"),
    (2.0, 1.0, 1, "at least 2 new tokens"),
])
def test_decode_tokens_per_s_rejects_meaningless_timings(
        t_full, t_one, n, match):
    with pytest.raises(ValueError, match=match):
        stats.decode_tokens_per_s(t_full, t_one, 1, n)


def test_acceptance_matches_vllm_definitions():
    # 10 drafts of 2 tokens: 8 first and 5 second tokens accepted.
    got = stats.acceptance(10, 20, 13, [8, 5])
    assert got["acceptance_rate"] == pytest.approx(13 / 20)
    assert got["mean_acceptance_length"] == pytest.approx(2.3)
    assert got["acceptance_rate_per_pos"] == pytest.approx([0.8, 0.5])
    none = stats.acceptance(0, 0, 0, None)
    assert none["acceptance_rate"] is None
    assert none["mean_acceptance_length"] is None
    with pytest.raises(ValueError, match="inconsistent"):
        stats.acceptance(10, 10, 11, [11])


def test_metric_delta_of_counters_and_vectors():
    before = {"c": 3, "v": [1, 2]}
    after = {"c": 10, "v": [4, 2], "new": 5}
    assert stats.metric_delta(before, after, "c") == 7
    assert stats.metric_delta(before, after, "v") == [3, 0]
    assert stats.metric_delta(before, after, "new") == 5
    assert stats.metric_delta(before, after, "missing") is None


def test_compare_flags_different_outputs():
    def cfg(k, tps, outs):
        return {"name": report.config_name(k), "num_speculative_tokens": k,
                "batches": [{"batch_size": 1, "decode_tokens_per_s": tps,
                             "best_decode_tokens_per_s": 2 * tps,
                             "decode_tokens_per_cpu_s": tps + 10,
                             "outputs": outs}]}

    rows = report.compare([cfg(0, 10.0, [[1, 2]]), cfg(1, 15.0, [[1, 3]])])
    assert rows == [{"config": "mtp_k1", "batch_size": 1, "speedup": 1.5,
                     "speedup_best": 1.5, "speedup_cpu": 25 / 20,
                     "outputs_identical": False}]
    assert report.compare([cfg(1, 15.0, [[1]])]) == []


# -- input checks ------------------------------------------------------------


def test_missing_model_is_a_clear_error(tmp_path):
    cfg = bench.BenchConfig(model=tmp_path / "nope")
    with pytest.raises(ValueError, match="no config.json"):
        cfg.validate()


def test_bad_arguments_are_rejected(tmp_path):
    write_random_glm45(tmp_path)
    for bad in (dict(new_tokens=1), dict(batch_sizes=[0]), dict(ks=[0])):
        with pytest.raises(ValueError):
            bench.BenchConfig(model=tmp_path, **bad).validate()
    (tmp_path / "p.json").write_text('[["a"]]')
    cfg = bench.BenchConfig(model=tmp_path,
                                    prompts_file=tmp_path / "p.json")
    with pytest.raises(ValueError, match="token id lists"):
        bench.load_prompts(cfg)


def test_baseline_flag_is_the_no_mtp_baseline_at_1_and_8():
    cfg = mtp_cli.config_from_args(mtp_cli.parse_args(["--baseline"]))
    assert (cfg.ks, cfg.batch_sizes) == ([], [1, 8])
    cfg = mtp_cli.config_from_args(
        mtp_cli.parse_args(["--k", "", "--batch-sizes", "1,8"]))
    assert (cfg.ks, cfg.batch_sizes) == ([], [1, 8])


# -- one small run -----------------------------------------------------------

N, B, R = 4, 1, 1


def _checkpoint_param_bytes(path: Path, num_layers: int) -> tuple[int, int]:
    """Bytes of the main model's and of the MTP layer's float32 tensors."""
    main = mtp = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118
            size = f.get_tensor(name).numel() * 4
            if name.startswith(f"model.layers.{num_layers}."):
                mtp += size
            else:
                main += size
    return main, mtp


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model = write_random_glm45(tmp_path_factory.mktemp("rand"))
    prompts = tmp_path_factory.mktemp("p") / "prompts.json"
    prompts.write_text(json.dumps([list(range(1, 12)), [7, 8, 9]]))
    cfg = bench.BenchConfig(model=model, ks=[1], batch_sizes=[B],
                                    new_tokens=N, repeats=R, warmup_tokens=2,
                                    kv_cache_bytes=16 << 20,
                                    prompts_file=prompts, timeout_s=300)
    logs = tmp_path_factory.mktemp("logs")
    return model, bench.run_benchmark(cfg, logs)


def test_run_schema(run):
    _, res = run
    assert res["schema_version"] == bench.SCHEMA_VERSION
    assert res["settings"]["batch_sizes"] == [B]
    assert "T_N - T_1" in res["settings"]["timing_method"]
    assert res["prompts"]["count"] == 2
    assert [c["name"] for c in res["configs"]] == ["no_mtp", "mtp_k1"]
    for c in res["configs"]:
        assert set(c["memory"]) >= {"peak_rss_bytes", "weights_bytes",
                                    "drafter_weights_bytes"}
        [batch] = c["batches"]
        assert batch["batch_size"] == B and len(batch["runs"]) == R
        assert "outputs" not in batch and len(batch["outputs_sha1"]) == 40
        assert Path(c["log"]).is_file()
    json.dumps(res)  # serializable as is


def test_run_numbers_are_consistent(run):
    model, res = run
    config = json.loads((model / "config.json").read_text())
    main_bytes, mtp_bytes = _checkpoint_param_bytes(
        model, config["num_hidden_layers"])
    for c in res["configs"]:
        [batch] = c["batches"]
        [r] = batch["runs"]
        assert r["t_full_s"] > r["t_one_s"] > 0
        assert batch["decode_tokens_per_s"] == pytest.approx(
            B * (N - 1) / (r["t_full_s"] - r["t_one_s"]))
        assert batch["decode_tokens_per_cpu_s"] == pytest.approx(
            B * (N - 1) / (r["cpu_full_s"] - r["cpu_one_s"]))
        assert batch["best_decode_tokens_per_s"] == \
            batch["decode_tokens_per_s"]  # one repeat
        assert batch["vllm_decode_tokens_per_s"] > 0
        mem = c["memory"]
        assert mem["peak_rss_bytes"] >= mem["peak_rss_after_load_bytes"] > 0
        # vLLM fuses tensors but keeps every parameter; buffers add.
        assert mem["weights_bytes"] >= main_bytes
    no_mtp, mtp = res["configs"]
    assert "acceptance" not in no_mtp["batches"][0]
    assert no_mtp["memory"]["drafter_weights_bytes"] == 0
    # The drafter shares nothing it does not own except embedding/head.
    assert 0 < mtp["memory"]["drafter_weights_bytes"] <= mtp_bytes
    acc = mtp["batches"][0]["acceptance"]
    # One draft per decode step; accepted drafts skip steps.
    attempts = sum(r["attempts"] for r in mtp["batches"][0]["runs"])
    assert 0 < acc["num_drafts"] <= B * (N - 1) * attempts
    assert acc["num_draft_tokens"] == acc["num_drafts"]
    assert 0 <= acc["num_accepted_tokens"] <= acc["num_draft_tokens"]
    assert acc["mean_acceptance_length"] == pytest.approx(
        1 + acc["num_accepted_tokens"] / acc["num_drafts"])
    assert sum(acc["num_accepted_tokens_per_pos"]) == \
        acc["num_accepted_tokens"]
    # Forward timers: the draft runs once per verified draft (k = 1), the
    # target at least once per step; no draft without MTP.
    fwd = mtp["batches"][0]["forward_time"]
    assert fwd["draft_calls"] >= acc["num_drafts"] > 0
    assert fwd["target_calls"] >= acc["num_drafts"]
    assert fwd["draft_over_target"] == pytest.approx(
        fwd["draft_ms_per_forward"] / fwd["target_ms_per_forward"])
    assert "draft_calls" not in no_mtp["batches"][0]["forward_time"]


def test_run_outputs_identical_and_ratio(run):
    _, res = run
    no_mtp, mtp = res["configs"]
    assert res["outputs_identical"] is True
    assert (mtp["batches"][0]["outputs_sha1"] ==
            no_mtp["batches"][0]["outputs_sha1"])
    [row] = res["comparison"]
    assert row["speedup"] == pytest.approx(
        mtp["batches"][0]["decode_tokens_per_s"] /
        no_mtp["batches"][0]["decode_tokens_per_s"])


def test_run_report_files(run, tmp_path):
    _, res = run
    table = report.format_table(res)
    assert "mtp_k1 ratio" in table and "identical to without: yes" in table
    report.write_json(res, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text()) == res
    report.write_plot(res, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _batch(size, tok_s, outputs, share=0.1, acc=None):
    return {"batch_size": size, "decode_tokens_per_s": tok_s,
            "outputs": outputs, "collective_share": share,
            **({"acceptance": acc} if acc else {})}


def test_parallel_rows_sum_ranks_and_compare_with_dp1():
    from tools.bench import parallel
    acc = {"num_draft_tokens": 10, "num_accepted_tokens": 9}
    a, b = [[1, 2]], [[3, 4]]
    layouts = {
        ("dp1", "no_mtp"): [{"batches": [_batch(2, 100.0, a + b)]}],
        ("dp2_ep", "no_mtp"): [{"batches": [_batch(1, 30.0, a, 0.4)]},
                               {"batches": [_batch(1, 40.0, b, 0.5)]}],
        ("dp1", "mtp_k1"): [{"batches": [_batch(2, 150.0, a + b, 0,
                                                acc)]}],
        # Rank 1 decoded another token: not identical.
        ("dp2_ep", "mtp_k1"): [{"batches": [_batch(1, 60.0, a, 0.3, acc)]},
                               {"batches": [_batch(1, 60.0, [[3, 5]], 0.2,
                                                   acc)]}],
    }
    rows = {(r["layout"], r["config"]): r
            for r in parallel.rows(layouts, [1])}
    dp2 = rows[("dp2_ep", "no_mtp")]
    assert dp2["tokens_per_s"] == 70.0 and dp2["collective_share"] == 0.5
    assert dp2["dp2_over_dp1"] == 0.7 and dp2["same_as_dp1_no_mtp"]
    mtp = rows[("dp2_ep", "mtp_k1")]
    assert mtp["mtp_over_no_mtp"] == 120.0 / 70.0
    assert mtp["dp2_over_dp1"] == 120.0 / 150.0
    assert mtp["acceptance_rate"] == 0.9
    assert not mtp["same_as_dp1_no_mtp"]
    assert rows[("dp1", "mtp_k1")]["same_as_dp1_no_mtp"]


def test_quantization_rows_put_precisions_side_by_side():
    from tools.bench import quantization

    def result(tok_s, mtp_tok_s, weights, same=True):
        return {"configs": [
            {"name": "no_mtp", "memory": {"weights_bytes": weights,
                                          "drafter_weights_bytes": 0,
                                          "peak_rss_bytes": 1},
             "batches": [{"batch_size": 1, "decode_tokens_per_s": tok_s}]},
            {"name": "mtp_k1", "memory": {"weights_bytes": weights,
                                          "drafter_weights_bytes": 5,
                                          "peak_rss_bytes": 1},
             "batches": [{"batch_size": 1, "decode_tokens_per_s": mtp_tok_s,
                          "acceptance": {"acceptance_rate": 0.5}}]}],
            "comparison": [{"config": "mtp_k1", "batch_size": 1,
                            "outputs_identical": same}]}

    runs = {"float": result(100.0, 150.0, 40),
            "w8a8": result(50.0, 100.0, 10, same=False)}
    rows = {r["config"]: r for r in quantization.rows(runs)}
    assert rows["no_mtp"]["w8a8_over_float"] == 0.5
    assert rows["mtp_k1"]["float_mtp_over_no_mtp"] == 1.5
    assert rows["mtp_k1"]["w8a8_mtp_over_no_mtp"] == 2.0
    assert rows["mtp_k1"]["float_same_as_no_mtp"] is True
    assert rows["mtp_k1"]["w8a8_same_as_no_mtp"] is False
    memory = quantization.memory_rows(runs)
    assert [m["weights_over_float"] for m in memory] == [1, 1, 0.25, 0.25]
