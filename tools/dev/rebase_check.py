"""Apply the patch series onto another vLLM release and report each patch.

    python -m tools.dev.rebase_check [--version X] [--out DIR]

Fetches vLLM's source distribution of that release (default: the newest
final release on the package index pip is configured with) by name and
version, prints and records its sha256, commits it on top of v0.11.0 (so
that the merge finds the series' base blobs) and applies the series onto
it one patch at a time with a three-way merge (``git am -3``). Each patch
is reported as ``applies``, ``already upstream`` (nothing left to apply)
or ``conflicts`` (the files and the number of conflicting hunks; 0 hunks:
the file was deleted or moved upstream); a patch that conflicts is skipped
so that the ones after it are still tried. Writes ``rebase-<version>.json`` and
``rebase-<version>.md`` to DIR (default ``patches/``). Needs the package
index (or the sdist in the cache); not part of ``make test``.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from packaging.version import InvalidVersion, Version

from tools.dev import fetch_vllm_sdist, vllm_tree

PROJECT = fetch_vllm_sdist.PROJECT
SDIST_RE = re.compile(rf"^{PROJECT}-(.+)\.tar\.gz$")


def _listing() -> tuple[str, dict]:
    errors = []
    for index_url in fetch_vllm_sdist.configured_index_urls():
        req = urllib.request.Request(
            f"{index_url.rstrip('/')}/{PROJECT}/",
            headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return index_url, json.load(resp)
        except Exception as exc:  # try the next configured index
            errors.append(f"{index_url}: {exc}")
    raise SystemExit("cannot reach a package index for the vLLM release "
                     f"list ({'; '.join(errors)}); run online, or pass "
                     "--version X with vllm-X.tar.gz in the cache "
                     f"({fetch_vllm_sdist.default_cache_dir()}).")


def sdists(listing: dict) -> dict[Version, dict]:
    """Final releases that have a source distribution."""
    found = {}
    for entry in listing.get("files", []):
        match = SDIST_RE.match(entry["filename"])
        if not match or entry.get("yanked"):
            continue
        try:
            version = Version(match.group(1))
        except InvalidVersion:
            continue
        if not version.is_prerelease and not version.is_devrelease:
            found[version] = entry
    return found


def fetch_sdist(version: str | None, cache: Path) -> tuple[str, Path, str]:
    """(version, path, sha256) of the release's sdist, from the cache if
    it is there (a given version only), else from the index."""
    if version is not None:
        cached = cache / f"{PROJECT}-{version}.tar.gz"
        if cached.exists():
            return version, cached, fetch_vllm_sdist.sha256_of(cached)
    index_url, listing = _listing()
    available = sdists(listing)
    if not available:
        raise SystemExit(f"{index_url} lists no vLLM source distribution")
    chosen = Version(version) if version else max(available)
    if chosen not in available:
        raise SystemExit(f"{index_url} has no sdist of vLLM {chosen}; "
                         f"newest: {max(available)}")
    entry = available[chosen]
    target = cache / entry["filename"]
    cache.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        print(f"downloading {entry['filename']} ...", file=sys.stderr)
        partial = target.with_suffix(".partial")
        urllib.request.urlretrieve(entry["url"], partial)
        want = entry.get("hashes", {}).get("sha256")
        if want and fetch_vllm_sdist.sha256_of(partial) != want:
            partial.unlink()
            raise SystemExit(f"{entry['filename']}: sha256 does not match "
                             f"the index ({want})")
        partial.rename(target)
    return str(chosen), target, fetch_vllm_sdist.sha256_of(target)


def release_tree(sdist: Path, dest: Path) -> None:
    """v0.11.0, then the release on top of it as one commit: the three-way
    merge finds the series' base blobs."""
    vllm_tree.init_pristine(
        dest, fetch_vllm_sdist.fetch(fetch_vllm_sdist.default_cache_dir()))
    vllm_tree.git("rm", "-r", "-q", ".", cwd=dest)
    vllm_tree.extract_sdist(sdist, dest)
    vllm_tree.git("add", "-A", "-f", ".", cwd=dest)
    vllm_tree.git("commit", "-q", "--no-verify", "--allow-empty", "-m",
                  f"vLLM release {sdist.name}", cwd=dest,
                  env=vllm_tree.BASE_ENV)


def _am(tree: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **vllm_tree.APPLY_ENV)
    return subprocess.run(["git", "am", "-q", "-k", "--keep-cr", *args],
                          cwd=tree, capture_output=True, text=True, env=env)


def apply_each(tree: Path, patches: list[Path]) -> list[dict]:
    """Apply ``patches`` onto ``tree`` in order; one result per patch."""
    results = []
    for patch in patches:
        head = vllm_tree.git("rev-parse", "HEAD", cwd=tree).strip()
        proc = _am(tree, "-3", "--empty=drop", str(patch))
        if proc.returncode == 0:
            after = vllm_tree.git("rev-parse", "HEAD", cwd=tree).strip()
            state = "applies" if after != head else "already upstream"
            results.append({"patch": patch.name, "state": state})
            continue
        conflicted = vllm_tree.git("diff", "--name-only", "--diff-filter=U",
                                   cwd=tree).split()
        hunks = {
            f: sum(line.startswith("<<<<<<< ") for line in (
                tree / f).read_text(errors="replace").splitlines())
            for f in conflicted if (tree / f).exists()
        }
        _am(tree, "--abort")
        if not conflicted:
            results.append({"patch": patch.name, "state": "conflicts",
                            "files": {}, "detail": proc.stderr.strip()[-400:]})
        else:
            results.append({"patch": patch.name, "state": "conflicts",
                            "files": hunks})
    return results


def table(version: str, sha256: str, results: list[dict]) -> str:
    lines = [f"# The series on vLLM {version}", "",
             f"sdist sha256 `{sha256}`", "",
             "| patch | state | conflicting files (hunks) |",
             "|---|---|---|"]
    for r in results:
        files = ", ".join(f"`{f}` ({n})" for f, n in r.get("files",
                                                           {}).items())
        lines.append(f"| {r['patch']} | {r['state']} | "
                     f"{files or r.get('detail', '')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=os.environ.get("VLLM_VERSION")
                        or None)
    parser.add_argument("--out", type=Path, default=vllm_tree.PATCH_DIR.parent)
    args = parser.parse_args()
    version, sdist, sha256 = fetch_sdist(
        args.version, fetch_vllm_sdist.default_cache_dir())
    print(f"vLLM {version}: {sdist.name} sha256 {sha256}")
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "vllm"
        release_tree(sdist, tree)
        results = apply_each(tree, vllm_tree.series_patches())
    report = {"vllm_version": version, "sdist": sdist.name,
              "sha256": sha256, "patches": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rebase-{version}.json").write_text(
        json.dumps(report, indent=1) + "\n")
    text = table(version, sha256, results)
    (args.out / f"rebase-{version}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
