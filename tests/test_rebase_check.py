"""The rebase check's classification, offline: the series onto trees whose
state is known (v0.11.0 itself, the patched tree, a changed file)."""

import pytest

from tools.dev import fetch_vllm_sdist, rebase_check, vllm_tree

SDIST = fetch_vllm_sdist.default_cache_dir() / fetch_vllm_sdist.FILENAME


@pytest.fixture
def release(tmp_path):
    if not SDIST.exists():
        pytest.skip(f"needs {SDIST} (make install fetches it)")
    tree = tmp_path / "vllm"
    rebase_check.release_tree(SDIST, tree)  # "v0.11.0 released again"
    return tree


def test_series_applies_on_its_own_base(release):
    results = rebase_check.apply_each(release, vllm_tree.series_patches())
    assert {r["state"] for r in results} == {"applies"}
    assert len(results) == len(vllm_tree.series_patches())


def test_patches_already_upstream_and_conflicts(release):
    patches = vllm_tree.series_patches()
    vllm_tree.am_series(release, patches[:1])  # "upstream took 0001"
    target = release / "vllm" / "v1" / "engine" / "core_client.py"
    text = target.read_text()
    # Upstream rewrote the lines 0004 changes.
    line = "outputs, _ = self.engine_core.step_fn()"
    assert text.count(line) == 1
    target.write_text(text.replace(line, "outputs, _ = self.step_fn()"))
    vllm_tree.git("commit", "-q", "-am", "upstream change", cwd=release,
                  env=vllm_tree.BASE_ENV)
    results = {r["patch"][:4]: r
               for r in rebase_check.apply_each(release, patches)}
    assert results["0001"]["state"] == "already upstream"
    assert results["0004"]["state"] == "conflicts"
    assert results["0004"]["files"] == {"vllm/v1/engine/core_client.py": 1}
    # A conflict does not stop the rest.
    assert results["0009"]["state"] == "applies"


def test_newest_final_release_is_chosen():
    listing = {"files": [
        {"filename": "vllm-0.9.2.tar.gz"}, {"filename": "vllm-0.10.0.tar.gz"},
        {"filename": "vllm-0.11.0rc1.tar.gz"},
        {"filename": "vllm-0.10.1.tar.gz", "yanked": True},
        {"filename": "vllm-0.10.0-py3-none-any.whl"}]}
    versions = rebase_check.sdists(listing)
    assert str(max(versions)) == "0.10.0"


def test_report_table_names_each_patch():
    text = rebase_check.table("9.9.9", "ab" * 32, [
        {"patch": "0001-a.patch", "state": "applies"},
        {"patch": "0002-b.patch", "state": "conflicts",
         "files": {"x.py": 2}}])
    assert "| 0002-b.patch | conflicts | `x.py` (2) |" in text
    assert "vLLM 9.9.9" in text
