"""The nightly run: a clean smoke run passes against the committed smoke
baseline, and a run with regressions injected fails, naming each; a new
model's first baseline takes the default tolerances, so that its rerun
passes and a damaged MTP layer fails; the prompts are the user's."""

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tools.nightly import run as nightly
from tools.nightly.check import TOLERANCES, check_figure, compare
from tools.nightly.figures import collapsed

ROOT = Path(__file__).resolve().parents[2]
# `python -m tools.nightly`, run from the repository root (cwd=ROOT).
NIGHTLY = ["-m", "tools.nightly"]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-glm45"
HELDOUT = "heldout_prompts.json"
BASELINES = ROOT / "benchmarks" / "nightly"
SMOKE_BASELINE = BASELINES / "baseline-smoke.json"
# The CPU reference device runs the smoke plan eager.
MODE = "eager"


def _nightly(out: Path, *args: str,
             baseline: Path = SMOKE_BASELINE) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *NIGHTLY, "--smoke", "--baseline",
         str(baseline), "--out", str(out), *args],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """The clean smoke run and one with every kind of regression injected
    (a slowed drafter, one changed token, a draft with its own LM head:
    each shows in different figures), side by side (one torch thread
    each)."""
    root = tmp_path_factory.mktemp("nightly")
    jobs = {"clean": (),
            "injected": ("--setup", "tests.nightly.injections:all_kinds")}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_nightly, root / name, *args)
                   for name, args in jobs.items()}
        return {name: (root / name, f.result())
                for name, f in futures.items()}


def _regressions(proc: subprocess.CompletedProcess) -> list[str]:
    line = next((line for line in proc.stdout.splitlines()
                 if line.startswith("nightly: REGRESSION in ")), "")
    return line.removeprefix("nightly: REGRESSION in ").split(", ")


def test_clean_smoke_run_passes_and_writes_the_trend(smoke_runs):
    out, proc = smoke_runs["clean"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "nightly: no regression" in proc.stdout
    run = json.loads(next(out.glob("nightly-*.json")).read_text())
    figures = run["figures"]
    assert figures[f"accuracy.{MODE}.k1.prompts_equal"] == 16
    assert figures[f"invariant.{MODE}.k1.draft_shares_embed_and_head"] == 1
    assert abs(figures[f"acceptance.{MODE}.k1.minus_reference"]) <= 2
    page = (out / "trend.html").read_text()
    # The committed baseline (dashed) and this run's point, per figure.
    assert page.count("<svg") == len(figures)
    assert "stroke-dasharray" in page and "<circle" in page


@pytest.fixture(scope="module")
def injected(smoke_runs) -> list[str]:
    """The figures the injected run names as regressions."""
    _, proc = smoke_runs["injected"]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _regressions(proc)


def test_slowed_drafter_is_a_speed_regression(injected):
    assert f"speed.{MODE}.b1.k1.mtp_over_no_mtp" in injected, injected
    assert f"speed.{MODE}.b1.k1.host_ms_per_step" in injected, injected
    # The slowdown is outside the forwards, and acceptance is unchanged.
    assert f"speed.{MODE}.b1.k1.draft_over_target" not in injected
    assert not any(n.startswith("acceptance") for n in injected), injected


def test_one_changed_token_is_an_accuracy_regression(smoke_runs, injected):
    assert f"accuracy.{MODE}.k0.prompts_equal" in injected, injected
    assert f"accuracy.{MODE}.k1.prompts_equal" in injected, injected
    assert (f"accuracy {MODE}.k1: prompt 0 first differs at token 15"
            in smoke_runs["injected"][1].stdout)


def test_draft_owning_its_head_is_an_invariant_regression(injected):
    assert (f"invariant.{MODE}.k1.draft_shares_embed_and_head"
            in injected), injected
    assert f"memory.{MODE}.k1.draft_owned_mib" in injected, injected
    # The target's own figures are untouched.
    assert f"memory.{MODE}.k0.weights_mib" not in injected


def test_baseline_expecting_higher_acceptance_fails(smoke_runs, tmp_path):
    out, _ = smoke_runs["clean"]
    run = next(out.glob("nightly-*.json"))
    baseline = json.loads(SMOKE_BASELINE.read_text())
    name = f"acceptance.{MODE}.k1.rate"
    baseline["figures"][name] = json.loads(
        run.read_text())["figures"][name] + 5
    higher = tmp_path / "baseline.json"
    higher.write_text(json.dumps(baseline))
    proc = subprocess.run(
        [sys.executable, *NIGHTLY, "--compare", str(run), "--baseline",
         str(higher), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1
    assert _regressions(proc) == [name]
    assert "-2 pt  REGRESSION" in proc.stdout


def test_tolerance_kinds():
    points = {"kind": "points", "band": 2.0}
    assert not check_figure("a", 90.0, 88.5, points).regression
    assert check_figure("a", 90.0, 87.9, points).regression
    assert not check_figure("a", 90.0, 95.0, points).regression
    faster = {"kind": "ratio", "band": 0.35, "better": "higher"}
    assert check_figure("s", 1.2, 0.7, faster).regression
    assert not check_figure("s", 1.2, 0.9, faster).regression
    lower = {"kind": "ratio", "band": 0.02, "better": "lower"}
    assert check_figure("m", 100.0, 103.0, lower).regression
    assert not check_figure("m", 100.0, 50.0, lower).regression
    # A figure the baseline has and the run lost is a regression.
    rows = compare({}, {"figures": {"x": 1}, "tolerances": []})
    assert rows[0].regression and rows[0].status == "REGRESSION"


def test_collapsed_run_figures_and_their_tolerances():
    """The collapsed-MTP-layer run's figures: the watchdog's pauses (exact:
    a second pause, or none, is a regression) and MTP over no MTP."""
    result = {"configs": [
        {"num_speculative_tokens": 0},
        {"num_speculative_tokens": 1, "watchdog": {"num_pauses": 1}}],
        "comparison": [{"batch_size": 16, "speedup": 0.97}]}
    figures = collapsed(result)
    assert figures == {"watchdog.collapsed.k1.pauses": 1,
                       "speed.collapsed.b16.k1.mtp_over_no_mtp": 0.97}
    baseline = {"figures": figures}
    assert not any(r.regression for r in compare(figures, baseline))
    for now in ({**figures, "watchdog.collapsed.k1.pauses": 0},
                {**figures, "speed.collapsed.b16.k1.mtp_over_no_mtp": 0.5}):
        assert any(r.regression for r in compare(now, baseline)), now


def test_committed_baselines_use_the_default_tolerances():
    """The tolerances live in one place, tools.nightly.check.TOLERANCES: the
    committed baselines name their plan and carry none of their own."""
    for name, plan in (("baseline.json", "full"),
                       ("baseline-smoke.json", "smoke")):
        baseline = json.loads((BASELINES / name).read_text())
        assert "tolerances" not in baseline, name
        assert nightly.plan_name(baseline["settings"]) == plan
    assert TOLERANCES["smoke"] != TOLERANCES["full"]


def test_update_baseline_for_another_model_takes_the_defaults(tmp_path):
    run = {"created": "now", "figures": {"memory.x.peak_rss_mib": 1200.0},
           "settings": {"model": str(tmp_path / "new"), "plan_name": "smoke"}}
    path = tmp_path / "baseline.json"
    own = [{"match": "memory.*", "kind": "exact"}]
    # One for another model, with its own tolerances: replaced.
    path.write_text(json.dumps({"tolerances": own, "figures": {}, "settings":
                                {"model": str(FIXTURE)}}))
    written = nightly.update_baseline(path, run)
    assert "tolerances" not in written
    assert json.loads(path.read_text()) == written
    # Peak RSS 30 MiB up is within the default 25%.
    rss = compare({"memory.x.peak_rss_mib": 1230.0}, written,
                  TOLERANCES["smoke"])
    assert not rss[0].regression
    # The same model's baseline keeps its own tolerances.
    path.write_text(json.dumps({**written, "tolerances": own}))
    assert nightly.update_baseline(path, run)["tolerances"] == own


def test_prompt_formats(tmp_path):
    heldout = json.loads((FIXTURE / HELDOUT).read_text())
    ids = [p["token_ids"] for p in heldout[:3]]
    for data in ([p["text"] for p in heldout[:3]], heldout[:3], ids,
                 [{"text": p["text"]} for p in heldout[:3]]):
        path = tmp_path / "prompts.json"
        path.write_text(json.dumps(data))
        assert nightly.load_prompts(FIXTURE, path) == (ids, str(path))
    assert nightly.load_prompts(FIXTURE, None) == (
        [p["token_ids"] for p in heldout], str(FIXTURE / HELDOUT))
    for bad in ([], [[]], [1, 2], {"a": 1}, [[1, "x"]]):
        path.write_text(json.dumps(bad))
        with pytest.raises(nightly.CannotRun, match="expected a non-empty"):
            nightly.load_prompts(FIXTURE, path)


def test_no_prompts_is_refused_in_one_line(tmp_path):
    """A model without heldout_prompts.json and no --prompts: no engine
    starts, no baseline is written, one line says why (exit status 2)."""
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(FIXTURE / "config.json", model)
    baseline = tmp_path / "baseline.json"
    proc = _nightly(tmp_path / "out", "--model", str(model),
                    "--update-baseline", baseline=baseline)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"nightly: no prompts to measure acceptance on: {model} has no "
        f"{HELDOUT} and no --prompts FILE was given (a JSON list of "
        "strings); refusing to measure on random prompts"]
    assert not baseline.exists() and not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def new_model_runs(tmp_path_factory):
    """A new model as a user brings one: the fixture's weights in another
    folder without heldout_prompts.json, eight prompts as a JSON list of
    strings. Three smoke runs side by side: the first writes a new baseline
    (no file yet), the second (the unchanged model) and the third (a
    damaged MTP layer) write their own and are then checked against the
    first's with --compare."""
    root = tmp_path_factory.mktemp("new-model")
    model = root / "model"
    shutil.copytree(FIXTURE, model,
                    ignore=shutil.ignore_patterns(HELDOUT, "README.md"))
    prompts = root / "prompts.json"
    heldout = json.loads((FIXTURE / HELDOUT).read_text())
    prompts.write_text(json.dumps([p["text"] for p in heldout[:8]]))
    args = ("--model", str(model), "--prompts", str(prompts),
            "--update-baseline")
    jobs = {"first": (), "rerun": (),
            "damaged": ("--setup", "tests.nightly.injections:"
                        "damaged_mtp_layer")}
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {name: pool.submit(_nightly, root / name, *args, *extra,
                                     baseline=root / f"{name}.json")
                   for name, extra in jobs.items()}
        procs = {name: f.result() for name, f in futures.items()}
    for name, proc in procs.items():
        assert proc.returncode == 0, (name, proc.stdout[-3000:] +
                                      proc.stderr[-3000:])
    checks = {}
    for name in ("rerun", "damaged"):
        run = next((root / name).glob("nightly-*.json"))
        checks[name] = subprocess.run(
            [sys.executable, *NIGHTLY, "--compare", str(run),
             "--baseline", str(root / "first.json"), "--out",
             str(root / name)], capture_output=True, text=True, timeout=120,
            cwd=ROOT)
    return root, checks


# Three nightly runs of a new model (`make nightly`; the tolerance defaults
# and the prompt formats it relies on are tested above, in CI).
@pytest.mark.heavy
def test_new_models_baseline_passes_its_rerun(new_model_runs):
    root, checks = new_model_runs
    baseline = json.loads((root / "first.json").read_text())
    assert "tolerances" not in baseline
    assert baseline["settings"]["prompts"]["source"] == str(
        root / "prompts.json")
    assert baseline["settings"]["prompts"]["count"] == 8
    assert baseline["figures"][f"accuracy.{MODE}.k1.prompts_equal"] == 8
    proc = checks["rerun"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "nightly: no regression" in proc.stdout


@pytest.mark.heavy
def test_new_models_baseline_catches_a_damaged_mtp_layer(new_model_runs):
    _, checks = new_model_runs
    proc = checks["damaged"]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    regressions = _regressions(proc)
    assert f"acceptance.{MODE}.k1.rate" in regressions, regressions
    # The target's tokens and the draft's sharing are untouched.
    assert not any(n.startswith(("accuracy", "invariant"))
                   for n in regressions), regressions


@pytest.mark.npu
@pytest.mark.skipif(
    not os.environ.get("VLLM_ASCEND_NIGHTLY_NPU_MODEL"),
    reason="needs an Ascend server with 8 NPUs and a GLM-4.5 checkpoint "
    "named by VLLM_ASCEND_NIGHTLY_NPU_MODEL")
def test_nightly_on_npu_with_the_serve_preset(tmp_path):
    """The first run on a server writes its baseline; the second must pass
    against it (same machine, same checkpoint). The prompts: the fixture's
    held-out texts, tokenized by the checkpoint's tokenizer."""
    baseline = tmp_path / "baseline-npu.json"
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(
        [p["text"] for p in json.loads((FIXTURE / HELDOUT).read_text())]))
    args = [sys.executable, *NIGHTLY, "--device", "npu", "--preset",
            "serve", "--skip-reference", "--model",
            os.environ["VLLM_ASCEND_NIGHTLY_NPU_MODEL"], "--prompts",
            str(prompts), "--baseline", str(baseline), "--out",
            str(tmp_path / "runs")]
    first = subprocess.run(args + ["--update-baseline"], capture_output=True,
                           text=True, cwd=ROOT)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    assert second.returncode == 0, second.stdout[-3000:]
