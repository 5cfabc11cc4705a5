"""The patch series tool: stable export, and a check that catches bad
patches."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools.dev import vllm_tree

ROOT = Path(__file__).resolve().parent.parent


def test_export_after_apply_is_byte_identical(tmp_path):
    exported = vllm_tree.export_to(tmp_path)
    wanted = vllm_tree.series_patches()
    assert [p.name for p in exported] == [p.name for p in wanted]
    for new, old in zip(exported, wanted):
        assert new.read_bytes() == old.read_bytes(), new.name


def test_tree_is_pristine_tag_plus_series():
    count = vllm_tree.git("rev-list", "--count",
                          f"{vllm_tree.BASE_TAG}..HEAD").strip()
    assert int(count) == len(vllm_tree.series_patches())


def _copy_series(tmp_path: Path, mutate) -> Path:
    patches = vllm_tree.series_patches()
    for p in patches:
        (tmp_path / p.name).write_text(mutate(p.name, p.read_text()))
    (tmp_path / "series").write_text("".join(f"{p.name}\n" for p in patches))
    return tmp_path / "series"


def _check(series: Path) -> subprocess.CompletedProcess:
    return subprocess.run([
        sys.executable, "-m", "tools.dev.vllm_tree", "check", "--no-tests",
        "--no-style", "--series", str(series)
    ], capture_output=True, text=True, cwd=ROOT)


def test_check_passes_on_the_series(tmp_path):
    proc = _check(_copy_series(tmp_path, lambda _, text: text))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_check_fails_on_a_patch_that_does_not_apply(tmp_path):
    first = vllm_tree.series_patches()[0].name

    def corrupt(name, text):
        if name != first:
            return text
        # Change a removed line so the hunk no longer matches v0.11.0.
        return text.replace("\n-MTP_MODEL_TYPES = (",
                            "\n-MTP_MODEL_TYPES = [", 1)

    proc = _check(_copy_series(tmp_path, corrupt))
    assert proc.returncode != 0
    assert "does not apply" in proc.stdout + proc.stderr


@pytest.mark.parametrize("what,mutate", [
    ("Signed-off-by", lambda t: t.replace("Signed-off-by:", "Reviewed:")),
    ("[Tag]", lambda t: t.replace("Subject: [Spec Decode] ", "Subject: ", 1)),
])
def test_check_fails_on_bad_metadata(tmp_path, what, mutate):
    proc = _check(_copy_series(tmp_path, lambda _, text: mutate(text)))
    assert proc.returncode != 0
    assert what in proc.stdout + proc.stderr


PLACEHOLDER = "vllm-ascend developer <dev@vllm-ascend.invalid>"


@pytest.mark.parametrize("line", ["Signed-off-by", "From"])
def test_check_fails_on_an_incomplete_identity(tmp_path, line):
    def mutate(_, text):
        return re.sub(rf"^{line}: .*(\n .*)?$", f"{line}: <dev@huawei.com>",
                      text, count=1, flags=re.M)

    proc = _check(_copy_series(tmp_path, mutate))
    assert proc.returncode != 0
    assert "incomplete identity" in proc.stdout + proc.stderr


@pytest.mark.parametrize("ident,placeholder", [
    (PLACEHOLDER, True),
    ("A Person <a@example.com>", True),
    ("Team <team@users.noreply.a-team.example>", True),
    ("Tester <t@ci.test>", True),
    ("No Email <>", True),
    (" <someone@huawei.com>", True),
    ("Jane Doe <jane@huawei.com>", False),
    ("Ex Ample <ex@example-corp.com>", False),
])
def test_placeholder_identities(ident, placeholder):
    assert vllm_tree.placeholder_identity(ident) is placeholder


def _repo(tmp_path, monkeypatch, name=None, email=None) -> Path:
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "no-global"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    for key, value in (("user.name", name), ("user.email", email)):
        if value is not None:
            subprocess.run(["git", "-C", str(repo), "config", key, value],
                           check=True)
    return repo


def test_export_refuses_without_an_identity(tmp_path, monkeypatch):
    repo = _repo(tmp_path, monkeypatch)
    with pytest.raises(SystemExit, match="export needs a git identity"):
        vllm_tree.exporter_identity(repo)


def test_send_refuses_a_reserved_domain(tmp_path, monkeypatch):
    # The committed series may carry a team's stand-in identity; what is
    # sent upstream is signed by a person.
    repo = _repo(tmp_path, monkeypatch, "Team", "team@a-team.example")
    assert vllm_tree.exporter_identity(repo) == "Team <team@a-team.example>"
    with pytest.raises(SystemExit, match="send needs your own identity"):
        vllm_tree.sender_identity(repo)


def test_send_resigns_every_patch_with_the_sender():
    jane = "Jane Doe <jane@huawei.com>"
    for patch in vllm_tree.series_patches():
        text = vllm_tree.resign(patch.read_text(), jane)
        header, _, rest = text.partition("\n\n")
        message, _, diff = rest.partition("\n---\n")
        assert re.search(r"^From: Jane Doe <jane@huawei.com>$", header, re.M)
        sign_offs = re.findall(r"^Signed-off-by: (.*)$", message, re.M)
        assert sign_offs and sign_offs[-1] == jane, patch.name
        assert not any(vllm_tree.placeholder_identity(s) for s in sign_offs)
        # Subject, body and diff unchanged.
        assert diff == patch.read_text().partition("\n---\n")[2]
        assert vllm_tree.subject_of(patch) in header.replace("\n ", " ")


def test_export_signs_off_with_the_exporter(tmp_path, monkeypatch):
    repo = _repo(tmp_path, monkeypatch, "Jane Doe", "jane@huawei.com")
    assert vllm_tree.exporter_identity(repo) == "Jane Doe <jane@huawei.com>"
    env = {"GIT_AUTHOR_DATE": "2026-01-01T00:00:00", "GIT_COMMITTER_DATE":
           "2026-01-01T00:00:00"}
    vllm_tree.git("commit", "-q", "--allow-empty", "-m", "base", cwd=repo,
                  env=env)
    vllm_tree.git("tag", vllm_tree.BASE_TAG, cwd=repo)
    (repo / "a.py").write_text("a = 1\n")
    vllm_tree.git("add", "a.py", cwd=repo)
    vllm_tree.git("commit", "-q", "-m", "[Tag] a\n\nWhy.", cwd=repo, env=env)
    vllm_tree.sign_off_series("Jane Doe <jane@huawei.com>", tree=repo)
    body = vllm_tree.git("log", "-1", "--format=%B", cwd=repo)
    assert "Signed-off-by: Jane Doe <jane@huawei.com>" in body
    head = vllm_tree.git("rev-parse", "HEAD", cwd=repo)
    vllm_tree.sign_off_series("Jane Doe <jane@huawei.com>", tree=repo)
    assert vllm_tree.git("rev-parse", "HEAD", cwd=repo) == head  # idempotent


def test_upstream_style_flags_what_vllm_pre_commit_rejects(tmp_path):
    """vLLM's pinned yapf, isort and ruff, with its settings, on a file a
    patch touches: a clean file passes, each fault is named."""
    from tools.dev import fetch_vllm_sdist, upstream_style
    for name in ("pyproject.toml", ".pre-commit-config.yaml"):
        (tmp_path / name).write_text((vllm_tree.TREE / name).read_text())
    versions = upstream_style.pinned_versions(tmp_path)
    assert versions["yapf"] == "0.43.0" and versions["isort"] == "6.0.1"
    tools = upstream_style.install(versions,
                                   fetch_vllm_sdist.default_cache_dir())
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "good.py").write_text("import os\nimport sys\n\n\n"
                                 "def f(a, b):\n    return os.sep, sys.argv, "
                                 "a + b\n")
    (pkg / "bad.py").write_text("import sys\nimport os\n\n\n"
                                "def f( a,b ):\n    return os.sep, sys.argv, "
                                f"a + b  # {'x' * 60}\n")
    got = upstream_style.problems(tmp_path, ["vllm/good.py", "vllm/bad.py"],
                                  tools, versions)
    assert not [p for p in got if "good.py" in p], got
    assert any("vllm/bad.py: yapf 0.43.0" in p for p in got), got
    assert any("vllm/bad.py: isort 6.0.1" in p for p in got), got
    assert any("vllm/bad.py:6:" in p and "E501" in p for p in got), got
