"""The rebase check's verdicts, offline, on small synthetic repositories:
a base tagged like the series' base, a series made from it with ``git
format-patch``, and a "release" whose state is known."""

import subprocess
from pathlib import Path

import pytest

from tools.dev import rebase_check, vllm_tree

ENV = {**vllm_tree.BASE_ENV}
SIGN = "Signed-off-by: A Person <a.person@users.noreply.github.com>"

MODEL = '''\
import torch


class Layer:

    def __init__(self, size):
        self.size = size
        self.scale = 1.0

    def forward(self, positions, embeds):
        # mask position 0
        embeds[positions == 0] = 0
        return embeds * self.scale


def helper(x):
    total = compute_the_total(x)
    return total + 1
'''
CONFIG = '''\
METHODS = ("ngram", "eagle")


def check(method):
    if method not in METHODS:
        raise ValueError(f"unknown method {method}")
    return method
'''


def _write(tree: Path, files: dict[str, str | None]) -> None:
    for path, text in files.items():
        target = tree / path
        if text is None:
            target.unlink()
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def _git(tree: Path, *args: str) -> str:
    return vllm_tree.git(*args, cwd=tree, env=ENV)


@pytest.fixture
def base(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    _write(tree, {"pkg/model.py": MODEL, "pkg/config.py": CONFIG})
    _git(tree, "init", "-q", "-b", "main")
    _git(tree, "add", "-A")
    _git(tree, "commit", "-q", "-m", "base")
    _git(tree, "tag", vllm_tree.BASE_TAG)
    return tree


def make_series(tree: Path, out: Path,
                changes: list[tuple[str, dict, str]]) -> list[Path]:
    """One patch per (subject, files, extra body lines), each on the
    ones before it, as ``git format-patch`` files."""
    _git(tree, "checkout", "-q", "-b", "work", vllm_tree.BASE_TAG)
    for subject, files, extra in changes:
        _write(tree, files)
        _git(tree, "add", "-A")
        body = f"{subject}\n\nWhy it is needed.\n\n{extra}{SIGN}\n"
        _git(tree, "commit", "-q", "-m", body)
    names = _git(tree, *vllm_tree.FORMAT_PATCH_ARGS, "-o", str(out),
                 f"{vllm_tree.BASE_TAG}..HEAD").split()
    _git(tree, "checkout", "-q", "main")
    _git(tree, "branch", "-q", "-D", "work")
    return [Path(n) for n in names]


def judge_all(tree: Path, patches: list[Path],
              release: dict[str, str | None],
              fmt=None) -> dict[str, dict]:
    def populate(dest: Path) -> None:
        files = {"pkg/model.py": MODEL, "pkg/config.py": CONFIG}
        files.update(release)
        _write(dest, {k: v for k, v in files.items() if v is not None})

    ws = rebase_check.prepare(tree, patches, populate, "release")
    tip = _git(tree, "rev-parse", rebase_check.RELEASE_BRANCH)
    results = rebase_check.run(ws, patches, fmt=fmt)
    # Ports are committed on a detached HEAD: the release stays pristine
    # for the next patch.
    assert _git(tree, "rev-parse", rebase_check.RELEASE_BRANCH) == tip
    return {r["patch"][:4]: r for r in results}


MASK = MODEL.replace(
    "        embeds[positions == 0] = 0\n",
    "        embeds = torch.where(positions.unsqueeze(-1) == 0, 0,\n"
    "                             embeds)\n")


def test_applies_when_the_release_changed_elsewhere(base, tmp_path):
    patches = make_series(base, tmp_path / "p", [
        ("[Model] Mask without a sync", {"pkg/model.py": MASK}, "")])
    results = judge_all(base, patches, {
        "pkg/config.py": CONFIG.replace('"eagle")', '"eagle", "mtp")')})
    assert results["0001"]["verdict"] == "applies"
    assert results["0001"]["git_am_3"] == "applies"
    assert results["0001"]["hunks"][0]["function"] == "Layer.forward"
    assert results["0001"]["hunks"][0]["state"] != "present"


def test_already_upstream_in_another_format(base, tmp_path):
    patches = make_series(base, tmp_path / "p", [
        ("[Model] Mask without a sync", {"pkg/model.py": MASK}, "")])
    # Upstream made the same change, formatted otherwise (one line, a
    # comment of its own) and changed the lines around it.
    upstream = MODEL.replace(
        "        # mask position 0\n        embeds[positions == 0] = 0\n",
        "        # masking inputs at position 0\n"
        "        embeds = torch.where(positions.unsqueeze(-1) == 0, 0, "
        "embeds)\n").replace("self.scale = 1.0", "self.scale = 2.0")
    results = judge_all(base, patches, {"pkg/model.py": upstream})
    r = results["0001"]
    assert r["git_am_3"].startswith("fails")
    assert r["verdict"] == "already upstream"
    assert r["hunks"][0]["state"] == "present"
    assert r["hunks"][0]["upstream"] == "pkg/model.py:10"


def test_removed_line_still_upstream_is_not_upstream(base, tmp_path):
    patches = make_series(base, tmp_path / "p", [
        ("[Model] Mask without a sync", {"pkg/model.py": MASK}, "")])
    # The new line is there, but so is the old one: not the same change.
    upstream = MODEL.replace(
        "        embeds[positions == 0] = 0\n",
        "        embeds[positions == 0] = 0\n"
        "        embeds = torch.where(positions.unsqueeze(-1) == 0, 0, "
        "embeds)\n        embeds = embeds + 0\n")
    results = judge_all(base, patches, {"pkg/model.py": upstream})
    assert results["0001"]["hunks"][0]["state"] == "partial"
    assert results["0001"]["verdict"] != "already upstream"


def test_known_supersession_is_checked_on_the_release(base, tmp_path,
                                                      monkeypatch):
    subject = "[Config] Accept mtp"
    accept = CONFIG.replace('"eagle")', '"eagle", "mtp")')
    patches = make_series(base, tmp_path / "p", [
        (subject, {"pkg/config.py": accept}, "")])
    known = rebase_check.Supersession(
        "upstream accepts every method", "PR #1", [
            rebase_check.Check("pkg/config.py", r"returnmethod",
                               scope="check"),
            rebase_check.Check("pkg/config.py", r"METHODS=", present=False)])
    monkeypatch.setitem(rebase_check.SUPERSEDED, subject, known)
    upstream = CONFIG.replace(
        'METHODS = ("ngram", "eagle")\n', "").replace(
            '    if method not in METHODS:\n'
            '        raise ValueError(f"unknown method {method}")\n', "")
    r = judge_all(base, patches, {"pkg/config.py": upstream})["0001"]
    assert r["verdict"] == "already upstream"
    assert r["supersession"]["holds"]
    assert "PR #1" in r["action"]


def test_stale_supersession_is_reported(base, tmp_path, monkeypatch):
    subject = "[Config] Accept mtp"
    accept = CONFIG.replace('"eagle")', '"eagle", "mtp")')
    patches = make_series(base, tmp_path / "p", [
        (subject, {"pkg/config.py": accept}, "")])
    monkeypatch.setitem(
        rebase_check.SUPERSEDED, subject,
        rebase_check.Supersession("gone upstream", "PR #2", [
            rebase_check.Check("pkg/config.py", None, scope="check",
                               present=False)]))
    # The release still has check() and rewrote the tuple: a conflict.
    upstream = CONFIG.replace('("ngram", "eagle")', '("ngram", "eagle3")')
    r = judge_all(base, patches, {"pkg/config.py": upstream})["0001"]
    assert not r["supersession"]["holds"]
    assert r["supersession"]["checks"] == [
        "FAILS: pkg/config.py:4 (check) exists"]
    assert r["verdict"] == "conflicts"
    assert "stale" in r["action"]


def test_moved_function_is_found(base, tmp_path):
    patches = make_series(base, tmp_path / "p", [
        ("[Model] Mask without a sync", {"pkg/model.py": MASK}, "")])
    # Upstream moved the layer to pkg/layers/mtp.py and rewrote its
    # masking: the patch's file is gone, its function is elsewhere.
    moved = MODEL.replace("embeds[positions == 0] = 0",
                          "embeds = embeds.masked_fill(positions == 0, 0)")
    r = judge_all(base, patches, {"pkg/model.py": None,
                                  "pkg/layers/mtp.py": moved})["0001"]
    assert r["verdict"] == "moved"
    hunk = r["hunks"][0]
    assert hunk["moved_to"][0]["path"] == "pkg/layers/mtp.py"
    assert hunk["moved_to"][0]["name"] == "Layer.forward"
    assert "pkg/layers/mtp.py:10" in r["how"]


def test_conflict_names_file_and_function(base, tmp_path):
    patches = make_series(base, tmp_path / "p", [
        ("[Model] Mask without a sync", {"pkg/model.py": MASK}, ""),
        ("[Model] Helper adds two", {"pkg/model.py": MASK.replace(
            "return total + 1", "return total + 2")}, ""),
    ])
    upstream = MODEL.replace("embeds[positions == 0] = 0",
                             "embeds[positions <= 0] = 0")
    results = judge_all(base, patches, {"pkg/model.py": upstream})
    r = results["0001"]
    assert r["verdict"] == "conflicts"
    assert "pkg/model.py: 1 conflicting hunk(s)" in r["how"]
    assert r["hunks"][0]["function"] == "Layer.forward"
    # Each patch is judged alone on the release: 0002 does not inherit
    # 0001's conflict.
    assert results["0002"]["verdict"] == "applies"
    assert results["0002"]["hunks"][0]["function"] == "helper"


def test_applies_once_formatted_like_the_release(base, tmp_path):
    patches = make_series(base, tmp_path / "p", [
        ("[Model] Helper adds two", {"pkg/model.py": MODEL.replace(
            "return total + 1", "return total + 2")}, "")])
    # The release reformatted the line next to the patch's: no merge of
    # the patch as written survives that, one of the patch formatted the
    # release's way does.
    split = ("compute_the_total(x)", "compute_the_total(\n        x\n    )")

    def formatter(texts: dict[str, str]) -> dict[str, str]:
        return {k: v.replace(*split) for k, v in texts.items()}

    r = judge_all(base, patches, {"pkg/model.py": MODEL.replace(*split)},
                  fmt=formatter)["0001"]
    assert r["git_am_3"].startswith("fails")
    assert r["verdict"] == "applies"
    assert r["how"].startswith("three-way merge in the release's format")
    assert r["port"] == {"pkg/model.py": "merges"}


def test_depends_on_is_applied_first(base, tmp_path):
    first = "[Model] Mask without a sync"
    patches = make_series(base, tmp_path / "p", [
        (first, {"pkg/model.py": MASK}, ""),
        ("[Model] Scale after masking", {"pkg/model.py": MASK.replace(
            "                             embeds)\n",
            "                             embeds)\n"
            "        embeds = embeds * 2\n")}, f"Depends-on: {first}\n"),
    ])
    r = judge_all(base, patches, {})["0002"]
    assert r["depends_on"] == [patches[0].name]
    assert r["verdict"] == "applies"


def test_merge_takes_upstream_side_when_it_has_our_lines():
    base = "a = 1\nb = f(x,\n      y)\nc = 3\n"
    ours = "a = 1\nb = g(x,\n      y)\nc = 3\n"
    upstream = "a = 1\n# upstream's own comment\nb = g(x, y)\nc = 3\n"
    text, left = rebase_check.merge3(upstream, base, ours)
    assert left == [] and text == upstream
    text, left = rebase_check.merge3(upstream.replace("g(", "h("), base,
                                     ours)
    assert left == ["b = g(x,"]


def test_normalization_ignores_formatting():
    yapf = ["x = foo(a,", "        b)  # note",
            "y: Optional[List[int]] = {'k': 1}"]
    ruff = ["x = foo(", "    a,", "    b,", ")",
            'y: list[int] | None = {"k": 1}']
    assert rebase_check.norm_text(yapf) == rebase_check.norm_text(ruff)
    assert rebase_check.norm("    b,") == "b"


def test_parse_patch_counts_lines():
    text = ("Subject: x\n\n---\n"
            "diff --git a/f.py b/f.py\n--- a/f.py\n+++ b/f.py\n"
            "@@ -3,3 +3,4 @@ def g():\n a\n-b\n+c\n+d\n e\n")
    [fd] = rebase_check.parse_patch(text)
    [hunk] = fd.hunks
    assert hunk.added() == [(4, "c"), (5, "d")]
    assert hunk.removed() == [(4, "b")]
    assert hunk.first_change_old() == 4


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
        {"patch": "0001-a.patch", "subject": "[A] a", "verdict": "applies",
         "how": "git am -3 onto the release", "action": "send as is"},
        {"patch": "0002-b.patch", "subject": "[B] b", "verdict": "conflicts",
         "how": "x.py: 2 conflicting hunk(s)", "action": "rework",
         "hunks": [{"file": "x.py", "function": "f", "state": "absent",
                    "added": 1, "removed": 0, "upstream": "x.py:3"}]}])
    assert ("| 0002 [B] b | **conflicts** | x.py: 2 conflicting hunk(s) | "
            "rework |") in text
    assert "- `x.py` `f`: absent (upstream `x.py:3`" in text
    assert "vLLM 9.9.9" in text
    assert "1 applies" in text


def test_cli_keeps_version_and_out():
    out = subprocess.run(
        ["python", "-m", "tools.dev.rebase_check", "--help"],
        capture_output=True, text=True, cwd=vllm_tree.ROOT,
        check=True).stdout
    assert "--version" in out and "--out" in out and "--run-tests" in out
