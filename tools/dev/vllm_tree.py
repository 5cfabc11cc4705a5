"""Materialize, export and check the patched vLLM tree.

``vllm/`` is a git repository whose first commit is the pristine v0.11.0
source distribution (tagged ``v0.11.0``) and whose following commits are the
patches listed in ``patches/vllm/series``, one commit per patch. Subcommands:

* ``materialize``: create ``vllm/`` if missing (needs the cached sdist).
* ``apply``: reset ``vllm/`` to the pristine tag and ``git am`` the series.
* ``export``: write ``v0.11.0..HEAD`` back to ``patches/vllm/`` with
  ``git format-patch`` in a stable form (re-exporting changes no file).
* ``check``: every patch has a ``[Tag]`` subject, a body and
  ``Signed-off-by``; applies on the ones before it; passes vLLM's own
  pre-commit formatters and linters (the versions its config pins) on the
  files it touches; and each prefix of the series passes the tests its
  patches add or touch (``--tip-only``: every patch's tests once, with the
  whole series). With ``--alone``, each patch also applies alone on the
  pristine tag (after the patches it names in ``Depends-on:`` lines) and
  passes its own tests there.
* ``send``: the series for ``git send-email``, authored and signed off by
  the sender's own identity (never a reserved domain).

Run from the repository root: ``python3 -m tools.dev.vllm_tree <subcommand>``.
Standard library only (``make`` materializes the tree with the system Python
before the venv exists).
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tools.dev import fetch_vllm_sdist, upstream_style

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / "vllm"
PATCH_DIR = ROOT / "patches" / "vllm"
SERIES = PATCH_DIR / "series"
BASE_TAG = "v0.11.0"
# Fixed identity and date for the pristine commit, so that its hash (and so
# every ``git am`` on top of it) is the same on every machine.
BASE_ENV = {
    "GIT_AUTHOR_NAME": "vLLM release",
    "GIT_AUTHOR_EMAIL": "release@vllm.invalid",
    "GIT_AUTHOR_DATE": "2025-10-02T00:00:00+00:00",
    "GIT_COMMITTER_NAME": "vLLM release",
    "GIT_COMMITTER_EMAIL": "release@vllm.invalid",
    "GIT_COMMITTER_DATE": "2025-10-02T00:00:00+00:00",
}
SUBJECT_RE = re.compile(r"^\[[A-Za-z0-9][A-Za-z0-9 ._/-]*\] \S")
FORMAT_PATCH_ARGS = [
    "format-patch", "--no-signature", "--zero-commit", "--full-index",
    "--no-renames", "--encoding=UTF-8",
    "--keep-subject",
]


def git(*args: str, cwd: Path = TREE, env: dict | None = None,
        check: bool = True, capture: bool = True) -> str:
    full_env = dict(os.environ, **(env or {}))
    proc = subprocess.run(["git", *args], cwd=cwd, env=full_env, text=True,
                          capture_output=capture)
    if check and proc.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} failed in {cwd}:\n"
                         f"{proc.stdout or ''}{proc.stderr or ''}")
    return proc.stdout if capture else ""


def series_patches(series: Path = SERIES) -> list[Path]:
    if not series.exists():
        return []
    names = [
        line.strip() for line in series.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    missing = [n for n in names if not (series.parent / n).exists()]
    if missing:
        raise SystemExit(f"{series} lists missing patches: {missing}")
    return [series.parent / n for n in names]


def extract_sdist(sdist: Path, dest: Path) -> None:
    """Unpack a vLLM sdist into ``dest``, without its top folder."""
    with tarfile.open(sdist) as tar:
        top = sdist.name.removesuffix(".tar.gz") + "/"
        for member in tar.getmembers():
            if not member.name.startswith(top):
                continue
            member.name = member.name[len(top):]
            if member.name:
                tar.extract(member, dest, filter="data")


def init_pristine(dest: Path, sdist: Path) -> None:
    """Unpack the sdist into ``dest`` and commit it as the pristine tag."""
    dest.mkdir(parents=True)
    extract_sdist(sdist, dest)
    git("init", "-q", "-b", "main", cwd=dest)
    # Commits made in the tree carry the developer's own identity (git's
    # global config), never one set here.
    git("config", "core.autocrlf", "false", cwd=dest)
    git("add", "-A", "-f", ".", cwd=dest)
    git("commit", "-q", "--no-verify", "-m",
        f"vLLM {BASE_TAG} (pristine source distribution)", cwd=dest,
        env=BASE_ENV)
    git("tag", BASE_TAG, cwd=dest)


# Committer of applied patches where git has no identity configured (a
# fresh CI machine): committers are not part of an exported patch.
APPLY_ENV = {"GIT_COMMITTER_NAME": "vllm-ascend series",
             "GIT_COMMITTER_EMAIL": "series@vllm-ascend.invalid"}
# Domains that are nobody's (RFC 2606 and 6761): the top-level domains
# .example, .invalid, .localhost and .test, and example.com/.net/.org.
RESERVED_EMAIL_RE = re.compile(
    r"(\.example|\.invalid|\.localhost|\.test|[@.]example\.(com|org|net)|"
    r"@localhost(\.localdomain)?)>?$", re.I)


def incomplete_identity(ident: str) -> bool:
    """``ident`` is not ``Name <email>`` with both parts."""
    match = re.fullmatch(r"\s*(.*?)\s*<([^>]*)>\s*", ident)
    return match is None or not match.group(1) or not match.group(2)


def placeholder_identity(ident: str) -> bool:
    """``ident`` cannot certify the DCO upstream: incomplete, or an
    address on a reserved domain (a team's stand-in identity)."""
    return incomplete_identity(ident) or bool(
        RESERVED_EMAIL_RE.search(ident.strip().rstrip(">")))


def exporter_identity(cwd: Path = TREE) -> str:
    """The exporter's ``Name <email>`` from git's configuration, or a clear
    error: patches are signed off by a person."""
    name = git("config", "user.name", cwd=cwd, check=False).strip()
    email = git("config", "user.email", cwd=cwd, check=False).strip()
    ident = f"{name} <{email}>"
    if not name or not email or incomplete_identity(ident):
        raise SystemExit(
            f"export needs a git identity to sign off the patches, not "
            f"{ident!r}: git config --global user.name 'Your Name'; "
            "git config --global user.email you@your.org")
    return ident


def sender_identity(cwd: Path = TREE) -> str:
    """The identity that sends the series upstream: a person's own, as the
    DCO wants, never a reserved domain's."""
    ident = exporter_identity(cwd)
    if placeholder_identity(ident):
        raise SystemExit(
            f"send needs your own identity to sign off the patches, not "
            f"{ident!r} (a reserved domain): git config --global user.email "
            "you@your.org, then run send again")
    return ident


def am_series(tree: Path, patches: list[Path]) -> None:
    configured = git("config", "user.email", cwd=tree, check=False).strip()
    env = dict(os.environ, **({} if configured else APPLY_ENV))
    for patch in patches:
        proc = subprocess.run(
            ["git", "am", "-q", "-k", "--keep-cr",
             "--committer-date-is-author-date", str(patch)],
            cwd=tree, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            subprocess.run(["git", "am", "--abort"], cwd=tree,
                           capture_output=True)
            raise SystemExit(f"{patch.name} does not apply:\n"
                             f"{proc.stdout}{proc.stderr}")


def cmd_materialize(_: argparse.Namespace) -> None:
    if (TREE / ".git").exists():
        return
    if TREE.exists():
        raise SystemExit(f"{TREE} exists but is not a git repository; move it "
                         "away and run again")
    sdist = fetch_vllm_sdist.fetch(fetch_vllm_sdist.default_cache_dir())
    init_pristine(TREE, sdist)
    am_series(TREE, series_patches())
    print(f"materialized {TREE} at {BASE_TAG} + "
          f"{len(series_patches())} patches")


def cmd_apply(_: argparse.Namespace) -> None:
    cmd_materialize(_)
    if git("status", "--porcelain"):
        raise SystemExit(f"{TREE} has uncommitted changes; commit and export "
                         "them, or discard them, before re-applying")
    exported = export_to(Path(tempfile.mkdtemp()))
    current = {p.name: p.read_bytes() for p in exported}
    wanted = {p.name: p.read_bytes() for p in series_patches()}
    if current == wanted:
        return
    if current and set(current) - set(wanted) | {
            n for n in current if n in wanted and current[n] != wanted[n]}:
        backup = f"backup/{git('rev-parse', '--short', 'HEAD').strip()}"
        git("branch", "-f", backup)
        print(f"unexported commits kept on branch {backup}")
    git("reset", "-q", "--hard", BASE_TAG)
    am_series(TREE, series_patches())
    print(f"applied {len(wanted)} patches on {BASE_TAG}")


def export_to(out_dir: Path, tree: Path = TREE) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    names = git(*FORMAT_PATCH_ARGS, "-o", str(out_dir), f"{BASE_TAG}..HEAD",
                cwd=tree).split()
    return [Path(n) for n in names]


def sign_off_series(ident: str, tree: Path = TREE) -> None:
    """Add ``Signed-off-by: ident`` to every commit of the series that
    lacks it (one rebase over the series, nothing else changes)."""
    trailer = f"Signed-off-by: {ident}"
    bodies = git("log", "--format=%B%x00", f"{BASE_TAG}..HEAD",
                 cwd=tree).split("\0")
    if all(trailer in body for body in bodies if body.strip()):
        return
    git("rebase", "-q", BASE_TAG, "--exec",
        "git commit -q --amend --no-edit --no-verify --signoff", cwd=tree)


def cmd_export(_: argparse.Namespace) -> None:
    if git("status", "--porcelain"):
        raise SystemExit(f"{TREE} has uncommitted changes: commit them there "
                         "first (one commit per patch)")
    sign_off_series(exporter_identity())
    with tempfile.TemporaryDirectory() as tmp:
        new = export_to(Path(tmp))
        PATCH_DIR.mkdir(parents=True, exist_ok=True)
        new_names = {p.name for p in new}
        for old in PATCH_DIR.glob("*.patch"):
            if old.name not in new_names:
                old.unlink()
        changed = 0
        for patch in new:
            dest = PATCH_DIR / patch.name
            if not dest.exists() or dest.read_bytes() != patch.read_bytes():
                shutil.copyfile(patch, dest)
                changed += 1
    series = "".join(f"{p.name}\n" for p in new)
    if not SERIES.exists() or SERIES.read_text() != series:
        SERIES.write_text(series)
        changed += 1
    print(f"exported {len(new)} patches ({changed} files changed)")


def resign(text: str, ident: str) -> str:
    """One exported patch, authored and signed off by ``ident`` alone: the
    stand-in identities (reserved domains) go, every other sign-off
    stays."""
    header, sep, rest = text.partition("\n\n")
    header = re.sub(r"^From: .*(\n .*)*$", f"From: {ident}", header,
                    count=1, flags=re.M)
    message, dashes, diff = rest.partition("\n---\n")
    lines = [ln for ln in message.split("\n")
             if not (ln.startswith("Signed-off-by: ")
                     and placeholder_identity(ln[len("Signed-off-by: "):]))]
    trailer = f"Signed-off-by: {ident}"
    if trailer not in lines:
        while lines and not lines[-1].strip():
            lines.pop()
        if not re.match(r"^[\w-]+: ", lines[-1]):
            lines.append("")
        lines.append(trailer)
    return header + sep + "\n".join(lines) + dashes + diff


def cmd_send(args: argparse.Namespace) -> None:
    """Write the series for ``git send-email``, signed by the sender."""
    ident = sender_identity()
    out = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for patch in series_patches():
        (out / patch.name).write_text(resign(patch.read_text(), ident))
    print(f"wrote {len(series_patches())} patches to {out}, authored and "
          f"signed off by {ident}: git send-email --to=<list> {out}/*.patch")


def patch_problems(patch: Path) -> list[str]:
    """Metadata rules every patch of the series follows."""
    text = patch.read_text(encoding="utf-8")
    header, _, rest = text.partition("\n\n")
    subject = re.search(r"^Subject: (.*(?:\n .*)*)", header, re.M)
    subject_text = re.sub(r"\s*\n\s+", " ", subject.group(1)) if subject \
        else ""
    subject_text = re.sub(r"^\[PATCH[^\]]*\] ", "", subject_text)
    body = rest.split("\n---\n", 1)[0]
    problems = []
    if not SUBJECT_RE.match(subject_text):
        problems.append(f"subject {subject_text!r} has no leading [Tag]")
    lines = [ln for ln in body.splitlines() if ln.strip()]
    prose = [ln for ln in lines if not re.match(r"^[\w-]+-by: ", ln)]
    if not prose:
        problems.append("no body saying why")
    sign_offs = [ln[len("Signed-off-by: "):] for ln in lines
                 if ln.startswith("Signed-off-by: ")]
    if not sign_offs:
        problems.append("no Signed-off-by")
    author = re.search(r"^From: (.*(?:\n .*)*)", header, re.M)
    authors = [re.sub(r"\s*\n\s+", " ", author.group(1))] if author else []
    for ident in sign_offs + authors:
        if incomplete_identity(ident):
            problems.append(f"incomplete identity {ident!r}: author and sign "
                            "off as 'Name <email>'")
    return problems


def tests_of(patch: Path) -> list[str]:
    """Test files (vLLM's tests/ layout) that a patch adds or changes."""
    files = re.findall(r"^\+\+\+ b/(tests/\S+\.py)$", patch.read_text(), re.M)
    return sorted({f for f in files if Path(f).name.startswith("test_")})


def sources_of(patch: Path) -> set[str]:
    """Files outside tests/ that a patch adds or changes."""
    files = re.findall(r"^\+\+\+ b/(\S+)$", patch.read_text(), re.M)
    return {f for f in files if not f.startswith("tests/")}


def subject_of(patch: Path) -> str:
    header = patch.read_text(encoding="utf-8").partition("\n\n")[0]
    subject = re.search(r"^Subject: (.*(?:\n .*)*)", header, re.M)
    text = re.sub(r"\s*\n\s+", " ", subject.group(1)) if subject else ""
    return re.sub(r"^\[PATCH[^\]]*\] ", "", text)


def prerequisites(patch: Path, patches: list[Path]) -> list[Path]:
    """The earlier patches that ``patch`` names in ``Depends-on: <subject>``
    lines (and theirs), in series order: a stacked pull request."""
    by_subject = {subject_of(p): p for p in patches}
    wanted, todo = set(), [patch]
    while todo:
        for subject in re.findall(r"^Depends-on: (.+)$",
                                  todo.pop().read_text(encoding="utf-8"),
                                  re.M):
            if subject.strip() not in by_subject:
                raise SystemExit(f"{patch.name}: Depends-on names no patch "
                                 f"of the series: {subject!r}")
            dep = by_subject[subject.strip()]
            if dep not in wanted:
                wanted.add(dep)
                todo.append(dep)
    return [p for p in patches if p in wanted]


def cmd_check(args: argparse.Namespace) -> None:
    patches = series_patches(args.series)
    failures = []
    for patch in patches:
        failures += [f"{patch.name}: {p}" for p in patch_problems(patch)]
    if failures:
        raise SystemExit("series check failed:\n  " + "\n  ".join(failures))
    sdist = fetch_vllm_sdist.fetch(fetch_vllm_sdist.default_cache_dir())
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "vllm"
        init_pristine(tree, sdist)
        if not args.no_style:
            versions = upstream_style.pinned_versions(tree)
            tools = upstream_style.install(
                versions, fetch_vllm_sdist.default_cache_dir())
        # Each patch in turn on the ones before it: it applies, and vLLM's
        # pinned formatters and linters pass on the files it touches.
        for i, patch in enumerate(patches, 1):
            am_series(tree, [patch])
            print(f"[{i}/{len(patches)}] {patch.name} applies", flush=True)
            if not args.no_style:
                failures += [
                    f"{patch.name}: {p}" for p in upstream_style.problems(
                        tree, sorted(sources_of(patch)) + tests_of(patch),
                        tools, versions)
                ]
        if failures:
            raise SystemExit("vLLM's pre-commit rejects the series:\n  " +
                             "\n  ".join(failures))
        if args.no_tests:
            pass
        elif args.tip_only:
            run_tests(tree, sorted({t for p in patches for t in tests_of(p)}),
                      "with the whole series")
        else:
            run_prefix_tests(tree, patches)
            if args.alone:
                run_alone_tests(tree, patches)
    print(f"series check passed: {len(patches)} patches")


def reset_to_base(tree: Path) -> None:
    git("reset", "-q", "--hard", BASE_TAG, cwd=tree)
    git("clean", "-q", "-fdx", cwd=tree)


def run_prefix_tests(tree: Path, patches: list[Path]) -> None:
    """At each prefix of the series, the last patch's tests and those of
    earlier patches whose sources it touches; at the last, every test (the
    series bisects)."""
    reset_to_base(tree)
    # Test file -> the source files of the patches that wrote it.
    covers: dict[str, set[str]] = {}
    for i, patch in enumerate(patches, 1):
        am_series(tree, [patch])
        sources, own = sources_of(patch), tests_of(patch)
        for test in own:
            covers[test] = covers.get(test, set()) | sources
        tests = sorted(test for test, touched in covers.items()
                       if i == len(patches) or test in own
                       or touched & sources)
        if tests:
            print(f"[{i}/{len(patches)}] tests up to {patch.name}",
                  flush=True)
            run_tests(tree, tests, f"with the series up to {patch.name}")


def run_alone_tests(tree: Path, patches: list[Path]) -> None:
    """Each patch alone on the base (after the patches it names in
    ``Depends-on:`` lines) applies and passes its own tests: one pull
    request each."""
    for patch in patches:
        tests, needs = tests_of(patch), prerequisites(patch, patches)
        reset_to_base(tree)
        try:
            am_series(tree, needs + [patch])
        except SystemExit as e:
            raise SystemExit(f"{patch.name} does not apply alone on "
                             f"{BASE_TAG} (name the patches it needs in "
                             f"Depends-on: lines): {e}") from None
        after = f" after {', '.join(p.name[:4] for p in needs)}" \
            if needs else ""
        print(f"[alone] {patch.name} on {BASE_TAG}{after}", flush=True)
        if tests:
            run_tests(tree, tests, f"{patch.name} alone on {BASE_TAG}")


def run_tests(tree: Path, tests: list[str], label: str) -> None:
    """Run ``tests`` against ``tree`` by putting it first on the path.

    The installed vLLM is python-only, so the checked-out prefix shadows it
    without a reinstall.
    """
    # vLLM's tests build partial checkpoints on purpose: the plugin's
    # startup check of complete GLM-4.5 checkpoints is not for them.
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}"
               f"{os.environ.get('PYTHONPATH', '')}",
               VLLM_ASCEND_SKIP_CHECKPOINT_CHECK="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         *tests], cwd=tree, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"tests fail: {label}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("materialize").set_defaults(func=cmd_materialize)
    sub.add_parser("apply").set_defaults(func=cmd_apply)
    sub.add_parser("export").set_defaults(func=cmd_export)
    check = sub.add_parser("check")
    check.add_argument("--series", type=Path, default=SERIES)
    check.add_argument("--no-tests", action="store_true",
                       help="only check that the series applies, its "
                       "metadata and its style")
    check.add_argument("--no-style", action="store_true",
                       help="skip vLLM's pinned formatters and linters")
    check.add_argument("--tip-only", action="store_true",
                       help="run every patch's tests once, with the whole "
                       "series (not at each prefix)")
    check.add_argument("--alone", action="store_true",
                       help="also apply each patch alone on the base and "
                       "run its tests there")
    check.set_defaults(func=cmd_check)
    send = sub.add_parser("send", help="the series for git send-email, "
                          "signed off by your own identity")
    send.add_argument("--out", type=Path, default=ROOT / "build" / "send")
    send.set_defaults(func=cmd_send)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
