"""Compare each patch of the series with another vLLM release, by content.

    python -m tools.dev.rebase_check [--version X] [--out DIR]
                                     [--run-tests] [--upstream-dir DIR]

Fetches vLLM's source distribution of that release (default: the newest
final release on the package index pip is configured with) by name and
version, prints and records its sha256, and judges every patch on its own
against the pristine release (after the patches it names in ``Depends-on:``
lines, never after the others):

* ``already upstream``: the release has the change. Every added line of
  the patch's non-test hunks (normalized: whitespace, line breaks, quotes,
  trailing commas, ``Optional``) is in the same function upstream (or where
  that function moved) and every removed line is gone from there; or a
  known supersession (``SUPERSEDED``: a reason, the upstream change and
  checks of the release's source) holds. The checks run on every release,
  so an entry that no longer holds is reported as stale, not trusted.
* ``applies``: ``git am -3`` onto the release succeeds, or the three-way
  merge succeeds once the patch's pre- and post-images are formatted with
  the release's own pinned ruff (upstream reformatted every file since
  v0.11.0, which no merge survives). Hunks upstream already has are left
  out. ``--run-tests`` then runs the patch's own tests on the ported tree
  in a second, python-only environment of the release.
* ``moved``: a file or function the patch changes is no longer where it
  was: the new place (a definition of the same name, or the file that holds
  the hunk's context lines) is reported.
* ``conflicts``: the rest, with the files, functions and a reason.

Writes ``rebase-<version>.json`` and ``rebase-<version>.md`` to DIR (default
``patches/``) and, with ``--upstream-dir``, the ported patches as ``git
format-patch`` files (only those that apply and, with ``--run-tests``, pass
their tests). Needs the package index (or the sdist in the cache); not part
of ``make test``.
"""

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from tools.dev import fetch_vllm_sdist, upstream_style, vllm_tree

PROJECT = fetch_vllm_sdist.PROJECT
SDIST_RE = re.compile(rf"^{PROJECT}-(.+)\.tar\.gz$")
SERIES_BRANCH = "series"
RELEASE_BRANCH = "release"
VERDICTS = ("already upstream", "applies", "moved", "conflicts")


# --- the release ---------------------------------------------------------


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


# --- the workspace: base, the series on it, the release on it ------------


@dataclass
class Workspace:
    """A git tree whose ``BASE_TAG`` is the series' base, branch ``series``
    the whole series on it (one commit per patch: every pre- and post-image
    blob for ``git am -3``) and branch ``release`` the release on the base
    (so the merge also finds the base's blobs)."""
    tree: Path
    commits: dict[str, str]  # patch name -> its commit on ``series``
    _cache: dict = field(default_factory=dict, repr=False)

    def show(self, rev: str, path: str) -> str | None:
        proc = subprocess.run(["git", "show", f"{rev}:{path}"],
                              cwd=self.tree, capture_output=True)
        if proc.returncode != 0:
            return None
        return proc.stdout.decode("utf-8", errors="replace")

    def upstream(self, path: str) -> str | None:
        if path not in self._cache:
            self._cache[path] = self.show(RELEASE_BRANCH, path)
        return self._cache[path]

    def upstream_files(self) -> list[str]:
        """The release's files; its Python sources are read into the
        cache at once (one ``git cat-file --batch``)."""
        if "\0files" not in self._cache:
            listing = vllm_tree.git("ls-tree", "-r", RELEASE_BRANCH,
                                    cwd=self.tree).splitlines()
            entries = [line.split("\t", 1) for line in listing]
            files = [(meta.split()[2], path) for meta, path in entries]
            wanted = [(blob, path) for blob, path in files
                      if path.endswith(".py") and path not in self._cache]
            proc = subprocess.run(
                ["git", "cat-file", "--batch"], cwd=self.tree,
                input="".join(f"{blob}\n" for blob, _ in wanted).encode(),
                capture_output=True, check=True)
            out, pos = proc.stdout, 0
            for _, path in wanted:
                end = out.index(b"\n", pos)
                size = int(out[pos:end].split()[2])
                self._cache[path] = out[end + 1:end + 1 + size].decode(
                    "utf-8", errors="replace")
                pos = end + 1 + size + 1
            self._cache["\0files"] = [path for _, path in files]
        return self._cache["\0files"]

    def reset(self) -> None:
        """The pristine release, on a detached HEAD: what is applied or
        committed next never moves the release branch."""
        vllm_tree.git("checkout", "-q", "-f", "--detach", RELEASE_BRANCH,
                      cwd=self.tree)
        vllm_tree.git("reset", "-q", "--hard", RELEASE_BRANCH, cwd=self.tree)
        vllm_tree.git("clean", "-q", "-fdx", cwd=self.tree)


def prepare(tree: Path, patches: list[Path],
            populate_release: Callable[[Path], None],
            label: str) -> Workspace:
    """``tree`` holds the base commit tagged ``BASE_TAG``; adds the series
    branch and the release branch (``populate_release`` fills the emptied
    work tree with the release's files)."""
    git = vllm_tree.git
    git("checkout", "-q", "-b", SERIES_BRANCH, vllm_tree.BASE_TAG, cwd=tree)
    vllm_tree.am_series(tree, patches)
    revs = git("rev-list", "--reverse", f"{vllm_tree.BASE_TAG}..HEAD",
               cwd=tree).split()
    commits = {p.name: rev for p, rev in zip(patches, revs)}
    git("checkout", "-q", "-b", RELEASE_BRANCH, vllm_tree.BASE_TAG, cwd=tree)
    git("rm", "-r", "-q", ".", cwd=tree)
    populate_release(tree)
    git("add", "-A", "-f", ".", cwd=tree)
    git("commit", "-q", "--no-verify", "--allow-empty", "-m", label,
        cwd=tree, env=vllm_tree.BASE_ENV)
    return Workspace(tree, commits)


def release_workspace(sdist: Path, dest: Path,
                      patches: list[Path]) -> Workspace:
    vllm_tree.init_pristine(
        dest, fetch_vllm_sdist.fetch(fetch_vllm_sdist.default_cache_dir()))
    return prepare(dest, patches,
                   lambda tree: vllm_tree.extract_sdist(sdist, tree),
                   f"vLLM release {sdist.name}")


def _am(tree: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **vllm_tree.APPLY_ENV)
    return subprocess.run(["git", "am", "-q", "-k", "--keep-cr", *args],
                          cwd=tree, capture_output=True, text=True, env=env)


def am_alone(ws: Workspace, patch: Path, needs: list[Path]) -> dict:
    """``git am -3`` of ``needs`` then ``patch`` onto the pristine release:
    {"ok", "empty" (nothing left to apply), "failed" (the patch that did
    not apply), "files" (conflicted file -> conflict hunks)}."""
    ws.reset()
    for p in needs + [patch]:
        head = vllm_tree.git("rev-parse", "HEAD", cwd=ws.tree).strip()
        proc = _am(ws.tree, "-3", "--empty=drop", str(p))
        if proc.returncode == 0:
            continue
        conflicted = vllm_tree.git("diff", "--name-only", "--diff-filter=U",
                                   cwd=ws.tree).split()
        files = {
            f: sum(line.startswith("<<<<<<< ") for line in (
                ws.tree / f).read_text(errors="replace").splitlines())
            for f in conflicted if (ws.tree / f).exists()
        }
        _am(ws.tree, "--abort")
        return {"ok": False, "failed": p.name, "files": files,
                "detail": proc.stderr.strip()[-300:]}
    after = vllm_tree.git("rev-parse", "HEAD", cwd=ws.tree).strip()
    return {"ok": True, "empty": after == head, "files": {}}


# --- the patch as hunks --------------------------------------------------


@dataclass
class Hunk:
    old_start: int
    new_start: int
    lines: list[tuple[str, str]] = field(default_factory=list)

    def _numbered(self, tag: str, start: int) -> list[tuple[int, str]]:
        """(line number on that side, text) of the lines tagged ``tag``:
        "+" on the post-image, "-" on the pre-image."""
        other = "-" if tag == "+" else "+"
        out, n = [], start
        for line_tag, text in self.lines:
            if line_tag == tag:
                out.append((n, text))
            if line_tag != other:
                n += 1
        return out

    def added(self) -> list[tuple[int, str]]:
        return self._numbered("+", self.new_start)

    def removed(self) -> list[tuple[int, str]]:
        return self._numbered("-", self.old_start)

    def first_change_old(self) -> int:
        n = self.old_start
        for tag, _ in self.lines:
            if tag != " ":
                return max(n - (tag == "+"), 1)
            n += 1
        return self.old_start


@dataclass
class FileDiff:
    path: str
    new_file: bool = False
    deleted: bool = False
    hunks: list[Hunk] = field(default_factory=list)


HUNK_RE = re.compile(r"^@@ -(\d+)(?:,\d+)? \+(\d+)(?:,\d+)? @@")


def parse_patch(text: str) -> list[FileDiff]:
    """The files and hunks of a ``git format-patch`` file."""
    files: list[FileDiff] = []
    current: FileDiff | None = None
    hunk: Hunk | None = None
    body = text.split("\n---\n", 1)[-1]
    for line in body.split("\n"):
        if line.startswith("diff --git "):
            current = FileDiff(line.split(" b/", 1)[-1])
            files.append(current)
            hunk = None
        elif current is None:
            continue
        elif line.startswith("new file mode"):
            current.new_file = True
        elif line.startswith("deleted file mode"):
            current.deleted = True
        elif (m := HUNK_RE.match(line)):
            hunk = Hunk(int(m.group(1)), int(m.group(2)))
            current.hunks.append(hunk)
        elif hunk is not None and line[:1] in ("+", "-", " ") and not (
                line.startswith("+++ ") or line.startswith("--- ")):
            hunk.lines.append((line[:1], line[1:]))
        elif hunk is not None and line == "":
            hunk.lines.append((" ", ""))
    return files


def is_test(path: str) -> bool:
    return path.startswith("tests/")


# --- content: normalized lines, scopes ----------------------------------

MIN_CODE = 8  # normalized lines shorter than this ("else:", ")") say nothing
_TYPING = {"List": "list", "Dict": "dict", "Tuple": "tuple", "Set": "set",
           "Type": "type", "FrozenSet": "frozenset"}


def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return line[:i]
    return line


def _optional_to_union(text: str) -> str:
    while (i := text.find("Optional[")) >= 0:
        depth, opening = 0, i + len("Optional")
        for j in range(opening, len(text)):
            depth += {"[": 1, "]": -1}.get(text[j], 0)
            if depth == 0:
                break
        else:
            return text
        text = f"{text[:i]}{text[i + 9:j]}|None{text[j + 1:]}"
    return text


def _norm(line: str) -> str:
    text = re.sub(r"\s+", "", _strip_comment(line)).replace("'", '"')
    text = _optional_to_union(text)
    for old, new in _TYPING.items():
        text = re.sub(rf"\b{old}\[", f"{new}[", text)
    text = re.sub(r"\btyping\.", "", text)
    return re.sub(r",([)\]}])", r"\1", text)


def norm(line: str) -> str:
    """A line of code without what formatters change: comments,
    whitespace, quote style, trailing commas, typing's old generics."""
    return _norm(line).strip(",")


def norm_text(lines: list[str]) -> str:
    """Lines joined, normalized: line breaks say nothing either."""
    return re.sub(r",([)\]}])", r"\1", "".join(map(_norm, lines)))


def docstring_lines(source: str) -> set[int]:
    """Line numbers (1-based) of docstrings: prose, not behaviour."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    lines: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list) or not body:
            continue
        first = body[0]
        if (isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            lines.update(range(first.lineno, (first.end_lineno or
                                              first.lineno) + 1))
    return lines


@dataclass
class Scope:
    name: str  # qualified: Class.method
    start: int
    end: int


def scopes(source: str) -> list[Scope]:
    """Every class and function of a module, by qualified name."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found: list[Scope] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                  ast.ClassDef)):
                name = f"{prefix}{child.name}"
                start = min([child.lineno] +
                            [d.lineno for d in child.decorator_list])
                found.append(Scope(name, start, child.end_lineno
                                   or child.lineno))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def enclosing(source: str, line: int) -> Scope | None:
    """The innermost class or function holding ``line``."""
    inner = None
    for scope in scopes(source):
        if scope.start <= line <= scope.end and (
                inner is None or scope.start >= inner.start):
            inner = scope
    return inner


def find_scope(source: str, name: str) -> Scope | None:
    for scope in scopes(source):
        if scope.name == name:
            return scope
    return None


DEF_RE = re.compile(r"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+(\w+)",
                    re.M)


class DefIndex:
    """The release's Python sources (tests left out), read once: where each
    name is defined (``def``/``class``) and each file's normalized text."""

    def __init__(self, ws: Workspace):
        self.ws = ws
        self._index: dict[str, list[tuple[str, int]]] | None = None
        self._texts: dict[str, str] = {}
        self._flat: dict[str, str] = {}

    def paths(self) -> list[str]:
        return [p for p in self.ws.upstream_files()
                if p.endswith(".py") and not is_test(p)]

    def text(self, path: str) -> str:
        if path not in self._texts:
            self._texts[path] = self.ws.upstream(path) or ""
        return self._texts[path]

    def flat(self, path: str) -> str:
        if path not in self._flat:
            self._flat[path] = norm_text(self.text(path).splitlines())
        return self._flat[path]

    def where(self, name: str) -> list[tuple[str, int]]:
        if self._index is None:
            self._index = {}
            for path in self.paths():
                text = self.text(path)
                for m in DEF_RE.finditer(text):
                    line = text.count("\n", 0, m.start()) + 1
                    self._index.setdefault(m.group(1), []).append(
                        (path, line))
        return self._index.get(name, [])


# --- content: per hunk ---------------------------------------------------


def _code(lines: list[tuple[int, str]], skip: set[int]) -> list[str]:
    return [n for n in (norm(text) for num, text in lines if num not in skip)
            if len(n) >= MIN_CODE]


def _locate(region: list[str], context: list[str]) -> int | None:
    """Index in ``region`` of the first line whose normalized form is a
    context line's (the nearest context first)."""
    for ctx in context:
        if len(ctx) < MIN_CODE:
            continue
        for i, line in enumerate(region):
            if norm(line) == ctx:
                return i
    return None


def _narrow(region: list[str], hunk: Hunk) -> list[str]:
    """The part of ``region`` between the hunk's context lines (the whole
    region when they are not found)."""
    before, after, seen_change = [], [], False
    for tag, text in hunk.lines:
        if tag != " ":
            seen_change = True
        elif seen_change:
            after.append(norm(text))
        else:
            before.append(norm(text))
    start = _locate(region, list(reversed(before[-3:])))
    if start is None:
        return region
    end = _locate(region[start + 1:], after[:3])
    stop = start + 1 + end + 1 if end is not None else min(
        len(region), start + 2 * len(hunk.lines) + 2)
    return region[start:stop]


def analyse_hunk(ws: Workspace, fd: FileDiff, hunk: Hunk, pre: str,
                 post: str, index: DefIndex) -> dict:
    """Whether upstream has this hunk's change, and where to look."""
    scope = enclosing(pre, hunk.first_change_old()) if pre else None
    name = scope.name if scope else "<module>"
    added = _code(hunk.added(), docstring_lines(post))
    removed = _code(hunk.removed(), docstring_lines(pre))
    result = {"file": fd.path, "function": name, "added": len(added),
              "removed": len(removed)}
    upstream = ws.upstream(fd.path)
    where, region, start = fd.path, None, 1
    if upstream is None and (new := moved_file(ws, fd.path, pre)):
        where, upstream = new[0], ws.upstream(new[0])
        result["file_moved_to"] = f"{new[0]} ({new[1]})"
    if upstream is not None:
        if scope is None:
            region = upstream.splitlines()
        elif (found := find_scope(upstream, name)) is not None:
            region = upstream.splitlines()[found.start - 1:found.end]
            start = found.start
    if region is None and where != fd.path:
        # In the file's new place, under another name: the whole file.
        region = upstream.splitlines() if upstream else []
        result["moved_to"] = [{"path": where, "line": 1, "name": name}]
    if region is None:
        # The file or the function is gone from here: where is it now?
        moved = moved_scope(index, name, hunk) if scope is not None else []
        if not moved:
            result["state"] = "missing"
            result["moved_to"] = [{"path": p, "line": line} for p, line in
                                  find_file(index, fd.path, hunk)]
            return result
        result["moved_to"] = moved
        where, start = moved[0]["path"], moved[0]["line"]
        found = find_scope(index.text(where), moved[0]["name"])
        region = index.text(where).splitlines()[
            found.start - 1:found.end] if found else []
    result["upstream"] = f"{where}:{start}"
    whole = norm_text(region)
    narrowed = norm_text(_narrow(region, hunk))
    found_added = [a for a in added if a in whole]
    gone = [r for r in removed if r not in narrowed]
    result["added_found"] = len(found_added)
    result["removed_gone"] = len(gone)
    if len(found_added) == len(added) and len(gone) == len(removed):
        result["state"] = "present"
    elif found_added or (removed and gone):
        result["state"] = "partial"
        result["missing"] = [a for a in added if a not in whole][:3]
    else:
        result["state"] = "absent"
    return result


def _context(hunk: Hunk, size: int = MIN_CODE) -> list[str]:
    """The hunk's lines that the release may still have (context and
    removed), normalized."""
    return [n for n in (norm(t) for tag, t in hunk.lines if tag != "+")
            if len(n) >= size]


def moved_scope(index: DefIndex, name: str, hunk: Hunk,
                limit: int = 3) -> list[dict]:
    """Definitions of ``name``'s last part elsewhere in the release that
    are the same function: the same qualified name, or a third of the
    hunk's context lines (at least two) in their body."""
    context = _context(hunk)
    short = name.rsplit(".", 1)[-1]
    found = []
    for path, line in index.where(short):
        text = index.text(path)
        owner = enclosing(text, line)
        if owner is None or owner.name.rsplit(".", 1)[-1] != short:
            continue
        body = norm_text(text.splitlines()[owner.start - 1:owner.end])
        hits = sum(c in body for c in context)
        same = owner.name == name
        if same or hits >= max(2, len(context) // 3):
            found.append((not same, -hits, path, owner))
    found.sort(key=lambda f: f[:3])
    return [{"path": path, "line": owner.start, "name": owner.name,
             "context_found": f"{-hits}/{len(context)}"}
            for _, hits, path, owner in found[:limit]]


def find_file(index: DefIndex, path: str, hunk: Hunk,
              limit: int = 3) -> list[tuple[str, int]]:
    """Release files holding at least half of a hunk's context lines
    (where a file that is gone from its path went)."""
    context = _context(hunk, 12)
    if not context:
        return []
    base = Path(path).name
    scored = []
    for candidate in index.paths():
        hits = sum(c in index.flat(candidate) for c in context)
        if hits * 2 >= len(context):
            first = next((i for i, line in enumerate(
                index.text(candidate).splitlines(), 1)
                          if norm(line) in context), 1)
            scored.append((-hits, Path(candidate).name != base, candidate,
                           first))
    scored.sort()
    return [(candidate, line) for *_, candidate, line in scored[:limit]]


def analyse_patch(ws: Workspace, patch: Path, index: DefIndex) -> list[dict]:
    commit = ws.commits[patch.name]
    results = []
    for fd in parse_patch(patch.read_text(encoding="utf-8")):
        if is_test(fd.path):
            continue
        pre = ws.show(f"{commit}^", fd.path) or ""
        post = ws.show(commit, fd.path) or ""
        if fd.new_file:
            results.append(analyse_new_file(ws, fd, post, index))
            continue
        for hunk in fd.hunks:
            results.append(analyse_hunk(ws, fd, hunk, pre, post, index))
    return results


def analyse_new_file(ws: Workspace, fd: FileDiff, post: str,
                     index: DefIndex) -> dict:
    """A file the patch adds: upstream has it when its definitions and
    code are there (at that path or another)."""
    names = [s.name for s in scopes(post) if "." not in s.name]
    added = _code([(n, t) for n, t in enumerate(post.splitlines(), 1)],
                  docstring_lines(post))
    result = {"file": fd.path, "function": "<new file>",
              "added": len(added), "removed": 0}
    places = {p for name in names for p, _ in index.where(name)}
    text = index.text(fd.path) or None
    if text is None and not places:
        result.update(state="absent", added_found=0, removed_gone=0)
        return result
    candidates = ([fd.path] if text is not None else []) + sorted(places)
    best, best_hits = None, -1
    for path in candidates[:10]:
        hits = sum(a in index.flat(path) for a in added)
        if hits > best_hits:
            best, best_hits = path, hits
    result.update(upstream=f"{best}:1", added_found=best_hits,
                  removed_gone=0)
    result["state"] = ("present" if best_hits == len(added) else
                       "partial" if best_hits else "absent")
    if best != fd.path:
        result["moved_to"] = [{"path": best, "line": 1}]
    return result


# --- known supersessions, checked on the release's source ---------------


@dataclass
class Check:
    """``pattern`` (a regex over the normalized source, see ``norm_text``)
    is found (``present``) or not in ``path`` (in its definition
    ``scope`` if given); ``present=False`` with no pattern: the scope (or
    the file) is gone."""
    path: str
    pattern: str | None
    scope: str | None = None
    present: bool = True
    says: str = ""


@dataclass
class Supersession:
    reason: str
    change: str  # the upstream change (pull request) that did it
    checks: list[Check]


def _check(ws: Workspace, check: Check) -> tuple[bool, str]:
    text = ws.upstream(check.path)
    where = check.path + (f" ({check.scope})" if check.scope else "")
    if text is not None and check.scope:
        scope = find_scope(text, check.scope)
        if scope is None:
            text = None
        else:
            where = f"{check.path}:{scope.start} ({check.scope})"
            text = "\n".join(text.splitlines()[scope.start - 1:scope.end])
    if check.pattern is None:
        ok = (text is None) != check.present
        return ok, f"{where} {'exists' if text is not None else 'is gone'}"
    if text is None:
        return False, f"{where} is gone"
    hit = re.search(check.pattern, norm_text(text.splitlines()))
    ok = (hit is not None) == check.present
    return ok, f"{where} {'has' if hit else 'lacks'} /{check.pattern}/"


def verify(ws: Workspace, known: Supersession) -> tuple[bool, list[str]]:
    results = [_check(ws, c) for c in known.checks]
    return all(ok for ok, _ in results), [
        f"{'ok' if ok else 'FAILS'}: {says}" for ok, says in results
    ]


G = "vllm/model_executor/models/glm4_moe_mtp.py"
SPEC = "vllm/config/speculative.py"
EAGLE_UTILS = "vllm/v1/worker/gpu/spec_decode/eagle/utils.py"

# Patch subject -> why the release no longer needs it. Each check is run
# on the release being compared: one that fails marks the entry stale.
SUPERSEDED: dict[str, Supersession] = {
    "[Spec Decode] Accept glm4_moe_mtp as a speculative method":
    Supersession(
        "SpeculativeMethod nests the MTPModelTypes Literal (which lists "
        "glm4_moe_mtp) through EagleModelTypes, as the patch does; "
        "model-specific MTP methods are still rewritten to 'mtp'",
        "the release's speculative.py (no pull request found in the "
        "corpus searched)",
        [Check(SPEC, r'MTPModelTypes=Literal\[[^\]]*"glm4_moe_mtp"'),
         Check(SPEC, r"EagleModelTypes=Literal\[[^\]]*MTPModelTypes"),
         Check(SPEC, r"SpeculativeMethod=Literal\[[^\]]*EagleModelTypes"),
         Check(SPEC, r'inget_args\(MTPModelTypes\)andself.method!="mtp"')]),
    "[Bugfix] Run post_step in the in-process engine client":
    Supersession(
        "InprocClient.get_output calls EngineCore.post_step after each "
        "step, as the busy loop does",
        "vllm-project/vllm#30319 (Spec decode with "
        "VLLM_ENABLE_V1_MULTIPROCESSING=0; issue #27287)",
        [Check("vllm/v1/engine/core_client.py",
               r"outputs,model_executed=self.engine_core.step_fn\(\)"
               r"self.engine_core.post_step\(",
               scope="InprocClient.get_output")]),
    "[Spec Decode] Share the GLM-4.5 MTP embedding and LM head with the "
    "target":
    Supersession(
        "the draft loader shares the target's input embedding "
        "(maybe_share_target_embed) and LM head (share_target_lm_head, "
        "which also replaces every MTP layer's shared_head.head) after "
        "loading; the patch's EagleProposer is gone (model runner v2)",
        "vllm-project/vllm#27597 and #34385 (named in issue 31), then the "
        "model runner v2 draft loader",
        [Check(EAGLE_UTILS, r"maybe_share_target_embed\(eagle_model,"
               r"draft_inner,target_inner\)", scope="load_eagle_model"),
         Check(EAGLE_UTILS, r"share_target_lm_head\(",
               scope="load_eagle_model"),
         Check(EAGLE_UTILS, r"sh.head=draft_head", scope="load_eagle_model"),
         Check("vllm/v1/spec_decode/eagle.py", None, present=False)]),
    "[Model] Mask GLM-4.5 MTP position-0 embeddings without a host sync":
    Supersession(
        "Glm4MoeMultiTokenPredictorLayer.forward masks position 0 with "
        "torch.where, out of place and without a host sync",
        "vllm-project/vllm#27643 ([MTP] Refactor mtp predictor to avoid d2h "
        "operation)",
        [Check(G, r"inputs_embeds=torch.where\(positions.unsqueeze\(-1\)==0,"
               r"0,inputs_embeds\)",
               scope="Glm4MoeMultiTokenPredictorLayer.forward"),
         Check(G, r"inputs_embeds\[positions==0\]=0", present=False)]),
    "[Bugfix] Naive all2all: gather and reduce over the DP group under TP":
    Supersession(
        "the naive all2all backend is removed ('naive' falls back to "
        "allgather_reducescatter), and AgRsAll2AllManager gathers over "
        "the DP group unless the MoE inputs are sequence parallel",
        "vllm-project/vllm#33728 ([WideEP] Remove naive all2all. Use "
        "allgather_reducescatter instead)",
        [Check("vllm/distributed/device_communicators/all2all.py", None,
               scope="NaiveAll2AllManager", present=False),
         Check("vllm/config/parallel.py",
               r'ifself.all2all_backendin\["pplx","naive"\]:'),
         Check("vllm/distributed/device_communicators/all2all.py",
               r"returnget_dp_group\(\)",
               scope="AgRsAll2AllManager._get_comm_group")]),
}


# Files of v0.11.0 that the release has elsewhere, rewritten (no name or
# context line of theirs survives to find them by). Each is kept only
# while its check holds on the release being compared.
MOVED: dict[str, tuple[str, Check]] = {
    "vllm/v1/worker/gpu_model_runner.py": (
        "vllm/v1/worker/gpu/model_runner.py",
        Check("vllm/v1/worker/gpu/model_runner.py", r"classGPUModelRunner")),
    "vllm/v1/spec_decode/eagle.py": (
        "vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py",
        Check("vllm/v1/worker/gpu/spec_decode/eagle/speculator.py",
              r"classEagleSpeculator\(TargetDependentARSpeculator\)")),
    "vllm/v1/engine/processor.py": (
        "vllm/v1/engine/input_processor.py",
        Check("vllm/v1/engine/input_processor.py",
              r"classInputProcessor:.*def_validate_params\(")),
    "vllm/entrypoints/openai/serving_chat.py": (
        "vllm/entrypoints/openai/chat_completion/serving.py",
        Check("vllm/entrypoints/openai/chat_completion/serving.py",
              r"classOpenAIServingChat\b")),
    "vllm/reasoning/glm4_moe_reasoning_parser.py": (
        "vllm/reasoning/glm47_moe_reasoning_parser.py",
        Check("vllm/reasoning/__init__.py",
              r'"glm45":\("glm47_moe_reasoning_parser"')),
    "vllm/entrypoints/openai/tool_parsers/glm4_moe_tool_parser.py": (
        "vllm/tool_parsers/glm47_moe_tool_parser.py",
        Check("vllm/tool_parsers/__init__.py",
              r'"glm45":\("glm47_moe_tool_parser"')),
}


def moved_file(ws: Workspace, path: str,
               pre: str = "") -> tuple[str, str] | None:
    """(new path, evidence) of a file gone from ``path``: a verified
    ``MOVED`` entry, else the one release file of the same name that
    defines one of the classes or functions the file defined."""
    if path in MOVED:
        new, check = MOVED[path]
        ok, says = _check(ws, check)
        if ok and ws.upstream(new) is not None:
            return new, "known move, checked"
    same = [f for f in ws.upstream_files()
            if Path(f).name == Path(path).name and not is_test(f)]
    names = {s.name for s in scopes(pre) if "." not in s.name}
    if len(same) == 1 and names & {
            s.name for s in scopes(ws.upstream(same[0]) or "")}:
        return same[0], "the release's only file of that name"
    return None


def known_supersession(patch: Path) -> Supersession | None:
    return SUPERSEDED.get(vllm_tree.subject_of(patch))


# --- porting: the three-way merge in the release's format ---------------

Formatter = Callable[[dict[str, str]], dict[str, str]]


def ruff_formatter(ws: Workspace, cache: Path) -> Formatter | None:
    """The release's pinned ruff (``ruff check --fix`` then ``ruff
    format`` with the release's settings), or None when it cannot be had."""
    pin = ws.upstream(".pre-commit-config.yaml") or ""
    m = re.search(r"ruff-pre-commit\s*\n\s*rev:\s*(\S+)(?:\s*#\s*frozen:"
                  r"\s*v?(\S+))?", pin)
    if m is None:
        return None
    version = (m.group(2) or m.group(1)).lstrip("v")
    try:
        tools = upstream_style.install({"ruff": version}, cache)
    except SystemExit as exc:
        print(f"no ruff {version}: {exc}", file=sys.stderr)
        return None
    settings = ws.upstream("pyproject.toml") or ""

    def run(texts: dict[str, str]) -> dict[str, str]:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            (root / "pyproject.toml").write_text(settings)
            names = [f for f in texts if f.endswith(".py")]
            for f in names:
                # The package the file belongs to, so that the import
                # sorting knows it as first party (pre/vllm/x.py: vllm).
                parts = Path(f).parts
                (root / parts[1 if parts[0] in ("pre", "post") else 0]
                 ).mkdir(exist_ok=True)
            for f, text in texts.items():
                (root / f).parent.mkdir(parents=True, exist_ok=True)
                (root / f).write_text(text)
            env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tools)}
            ruff = str(tools / "bin" / "ruff")
            if names:
                subprocess.run([ruff, "check", "--fix", "--exit-zero", "-q",
                                "--no-cache", *names], cwd=root, env=env,
                               capture_output=True)
                subprocess.run([ruff, "format", "-q", "--no-cache", *names],
                               cwd=root, env=env, capture_output=True)
            return {f: (root / f).read_text() for f in texts}

    run.version = version  # type: ignore[attr-defined]
    return run


CONFLICT_RE = re.compile(
    r"^<<<<<<< [^\n]*\n(.*?)^\|\|\|\|\|\|\| [^\n]*\n(.*?)^=======\n(.*?)"
    r"^>>>>>>> [^\n]*\n", re.M | re.S)


def merge3(upstream: str, base: str, ours: str) -> tuple[str, list[str]]:
    """``git merge-file`` (diff3 markers); a conflict whose every line of
    code of ours (normalized) upstream already has takes upstream's side.
    Returns the text and the conflicts left (ours, short)."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for name, text in (("upstream", upstream), ("base", base),
                           ("ours", ours)):
            path = Path(tmp) / name
            path.write_text(text)
            paths.append(str(path))
        proc = subprocess.run(["git", "merge-file", "-p", "--diff3",
                               *paths], capture_output=True, text=True)
    left: list[str] = []

    def resolve(m: re.Match) -> str:
        theirs, _, mine = m.group(1), m.group(2), m.group(3)
        flat = norm_text(theirs.splitlines())
        code = [n for n in map(norm, mine.splitlines()) if n]
        if all(c in flat for c in code):
            return theirs
        left.append(next((line.strip() for line in mine.splitlines()
                          if norm(line) not in flat), "")[:100])
        return m.group(0)

    text = CONFLICT_RE.sub(resolve, proc.stdout)
    return text, left


def port(ws: Workspace, patch: Path, fmt: Formatter | None,
         upstream_has: frozenset[str] = frozenset()) -> dict:
    """The patch's change merged onto the release file by file (pre- and
    post-images in the release's format): {file: {"text" or "problem"}}.
    Files in ``upstream_has`` (every hunk already upstream) are left as
    the release has them."""
    commit = ws.commits[patch.name]
    out = {}
    for fd in parse_patch(patch.read_text(encoding="utf-8")):
        if fd.path in upstream_has:
            continue
        pre = ws.show(f"{commit}^", fd.path)
        post = ws.show(commit, fd.path)
        up, target = ws.upstream(fd.path), fd.path
        if up is None and pre is not None and is_test(fd.path):
            # A test file an earlier patch added: the whole of it.
            pre = None
        elif up is None and pre is not None and (
                new := moved_file(ws, fd.path, pre)):
            target, up = new[0], ws.upstream(new[0])
        if fmt is not None:
            texts = {k: v for k, v in (("pre/" + fd.path, pre),
                                       ("post/" + fd.path, post))
                     if v is not None}
            done = fmt(texts)
            pre = done.get("pre/" + fd.path, pre)
            post = done.get("post/" + fd.path, post)
        if post is None:
            out[fd.path] = {"deleted": True} if up is not None else {}
        elif pre is None:
            out[fd.path] = ({"text": post} if up is None else
                            {"problem": "added by the patch, but the release "
                             "already has a file there"})
        elif up is None:
            out[fd.path] = {"problem": "gone from the release"}
        else:
            text, left = merge3(up, pre, post)
            where = "" if target == fd.path else f" in {target}"
            out[target] = {"text": text} if not left else {
                "problem": f"{len(left)} conflicting hunk(s){where}",
                "conflicts": left}
    return out


def commit_port(ws: Workspace, patch: Path, merged: dict) -> str | None:
    """Write a clean port on the release and commit it with the patch's
    message; None when nothing is left to change."""
    ws.reset()
    for path, res in merged.items():
        target = ws.tree / path
        if res.get("deleted"):
            target.unlink()
        elif "text" in res:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(res["text"])
    vllm_tree.git("add", "-A", "-f", *merged, cwd=ws.tree)
    if not vllm_tree.git("diff", "--cached", "--name-only", cwd=ws.tree):
        return None
    message = vllm_tree.git("log", "-1", "--format=%B",
                            ws.commits[patch.name], cwd=ws.tree)
    author = vllm_tree.git("log", "-1", "--format=%an <%ae>",
                           ws.commits[patch.name], cwd=ws.tree).strip()
    date = vllm_tree.git("log", "-1", "--format=%aI",
                         ws.commits[patch.name], cwd=ws.tree).strip()
    vllm_tree.git("commit", "-q", "--no-verify", "--author", author,
                  "--date", date, "-m", message, cwd=ws.tree,
                  env=vllm_tree.APPLY_ENV)
    return vllm_tree.git("rev-parse", "HEAD", cwd=ws.tree).strip()


# --- the verdict ---------------------------------------------------------


def judge(ws: Workspace, patch: Path, patches: list[Path], index: DefIndex,
          fmt: Formatter | None) -> dict:
    needs = vllm_tree.prerequisites(patch, patches)
    result: dict = {"patch": patch.name,
                    "subject": vllm_tree.subject_of(patch),
                    "depends_on": [p.name for p in needs]}
    hunks = analyse_patch(ws, patch, index)
    result["hunks"] = hunks
    am = am_alone(ws, patch, needs)
    result["git_am_3"] = ("applies" if am["ok"] and not am["empty"] else
                          "nothing to apply" if am["ok"] else
                          f"fails ({am['failed']}: "
                          f"{', '.join(am['files']) or am['detail']})")
    present = [h for h in hunks if h["state"] == "present"]
    known = known_supersession(patch)
    if known is not None:
        holds, evidence = verify(ws, known)
        result["supersession"] = {"reason": known.reason,
                                  "change": known.change, "holds": holds,
                                  "checks": evidence}
    if am["ok"] and am["empty"] or hunks and len(present) == len(hunks):
        result["verdict"] = "already upstream"
        result["how"] = ("git am -3 leaves nothing to apply" if am["ok"]
                         else "every added line is upstream and every "
                         "removed line gone, in the same functions")
        result["action"] = "drop the patch when moving to this release"
        if known is not None and result["supersession"]["holds"]:
            result["action"] += f" (upstream: {known.change})"
        return result
    if known is not None and result["supersession"]["holds"]:
        result["verdict"] = "already upstream"
        result["how"] = f"superseded: {known.reason}"
        result["action"] = ("drop the patch when moving to this release "
                            f"(upstream: {known.change})")
        return result
    if am["ok"]:
        result["verdict"] = "applies"
        result["how"] = "git am -3 onto the release"
        result["action"] = "send as is"
        return result
    done = sorted({h["file"] for h in hunks} - {
        h["file"] for h in hunks if h["state"] != "present"})
    merged = port(ws, patch, fmt, frozenset(done))
    result["port"] = {f: r.get("problem", "merges")
                      for f, r in merged.items()}
    conflicts = {f: r for f, r in merged.items() if "problem" in r}
    if not conflicts:
        result["verdict"] = "applies"
        version = getattr(fmt, "version", None)
        result["how"] = ("three-way merge in the release's format"
                         + (f" (ruff {version})" if version else ""))
        result["action"] = "send the ported patch"
        if done:
            result["how"] += ("; already upstream, left out of the port: "
                              + ", ".join(done))
        result["_merged"] = merged
        return result
    moved = [h for h in hunks if h.get("moved_to") or h.get("file_moved_to")]
    if moved:
        result["verdict"] = "moved"
        places = sorted({
            f"{h['file']} -> {h['file_moved_to']}" if h.get("file_moved_to")
            else f"{h['file']} ({h['function']}) -> "
            f"{h['moved_to'][0]['path']}:{h['moved_to'][0]['line']}"
            for h in moved})
        result["how"] = "; ".join(places)
        left = [f"{f}: {r['problem']}" for f, r in sorted(conflicts.items())
                if not any(p.startswith(f) for p in places)]
        if left:
            result["how"] += "; also " + "; ".join(left)
        result["action"] = "port the change to the new place(s)"
    else:
        result["verdict"] = "conflicts"
        result["how"] = "; ".join(
            f"{f}: {r['problem']}" + (f" at `{r['conflicts'][0]}`"
                                      if r.get("conflicts") else "")
            for f, r in sorted(conflicts.items()))
        result["action"] = "rework the patch on this release"
    if known is not None and not result["supersession"]["holds"]:
        result["action"] += "; the SUPERSEDED entry is stale: re-check it"
    return result


# --- tests of a port, in a python-only environment of the release -------


def run_port_tests(ws: Workspace, patch: Path, python: str,
                   timeout: int = 900) -> dict:
    tests = [t for t in vllm_tree.tests_of(patch) if (ws.tree / t).exists()]
    if not tests:
        return {"tests": "none"}
    env = dict(os.environ, PYTHONPATH=str(ws.tree),
               VLLM_TARGET_DEVICE="empty",
               VLLM_ASCEND_SKIP_CHECKPOINT_CHECK="1")
    env.pop("VLLM_ASCEND_NPU_DOUBLE", None)
    try:
        proc = subprocess.run(
            [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
             *tests], cwd=ws.tree, env=env, capture_output=True, text=True,
            timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"tests": "timeout", "files": tests}
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    summary = (lines[-1:] if proc.returncode == 0 or not errors
               else errors[:1] + lines[-1:])
    return {"tests": "pass" if proc.returncode == 0 else "fail",
            "files": tests, "summary": " / ".join(summary)[:300]}


def test_python(ws: Workspace, version: str, cache: Path,
                timeout: int = 3600) -> tuple[str | None, str]:
    """A venv with the release's runtime requirements (its pinned torch
    and ``requirements/common.txt``, from the index) and pytest, made once
    under the cache (tblib: the release's tests/conftest.py imports it):
    vLLM itself is the ported tree, put first on
    PYTHONPATH (python-only, nothing to build)."""
    venv = cache / f"vllm-{version}-python-only"
    python = venv / "bin" / "python"
    if (venv / ".complete").exists():
        return str(python), "ready"
    pins = re.findall(r'"(torch\s*==\s*[^"]+)"',
                      ws.upstream("pyproject.toml") or "")
    common = ws.upstream("requirements/common.txt")
    if not pins or common is None:
        return None, "the release names no torch pin or common requirements"
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)],
                   check=True)
    with tempfile.TemporaryDirectory() as tmp:
        reqs = Path(tmp) / "common.txt"
        reqs.write_text(common)
        try:
            proc = subprocess.run(
                [str(python), "-m", "pip", "install", "-q",
                 pins[0].replace(" ", ""), "-r", str(reqs), "pytest",
                 "tblib"],
                capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, (f"installing vLLM {version}'s requirements took "
                          f"over {timeout} s")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [""])[-1]
        return None, (f"cannot install vLLM {version}'s requirements: "
                      f"{last[:300]}")
    (venv / ".complete").touch()
    return str(python), "ready"


# --- the report ----------------------------------------------------------


def _hunk_line(h: dict) -> str:
    where = h.get("upstream") or "not found"
    counts = (f"added {h.get('added_found', 0)}/{h['added']} found, "
              f"removed {h.get('removed_gone', 0)}/{h['removed']} gone")
    moved = ""
    if h.get("moved_to"):
        moved = " -> moved to " + ", ".join(
            f"`{m['path']}:{m['line']}`" for m in h["moved_to"][:3])
    missing = ""
    if h.get("missing"):
        missing = f"; not upstream: `{h['missing'][0][:70]}`"
    return (f"- `{h['file']}` `{h['function']}`: {h['state']} "
            f"(upstream `{where}`; {counts}){moved}{missing}")


def table(version: str, sha256: str, results: list[dict],
          notes: list[str] | None = None) -> str:
    counts = {v: sum(r["verdict"] == v for r in results) for v in VERDICTS}
    lines = [f"# The series on vLLM {version}", "",
             f"sdist sha256 `{sha256}`. Each patch alone on the pristine "
             "release (after its `Depends-on:` patches), compared by "
             "content; generated by `make rebase-check` "
             "(tools/dev/rebase_check.py).", "",
             ", ".join(f"{n} {v}" for v, n in counts.items()), "",
             "Verdicts: *already upstream*: the release has the change (every "
             "added line, normalized for formatting, in the same function "
             "and every removed line gone; or a known supersession whose "
             "checks of the release's source hold, listed per patch); "
             "*applies*: `git am -3`, or the three-way merge of the patch "
             "formatted with the release's pinned ruff, succeeds (hunks "
             "already upstream left out); *moved*: a file or function the "
             "patch changes is elsewhere now (the new place is named); "
             "*conflicts*: the rest, with files and functions.", "",
             "| patch | verdict | evidence | what to do |",
             "|---|---|---|---|"]
    for r in results:
        how = r.get("how", "").replace("|", "\\|")
        extra = ""
        if r.get("tests"):
            extra = f" Tests on the port: {r['tests']['tests']}."
        lines.append(f"| {r['patch'][:4]} {r['subject']} | **{r['verdict']}**"
                     f" | {how}{extra} | {r.get('action', '')} |")
    for note in notes or []:
        lines += ["", note]
    lines += ["", "## Per patch", ""]
    for r in results:
        lines.append(f"### {r['patch']}")
        lines.append("")
        lines.append(f"- verdict: **{r['verdict']}** ({r.get('how', '')})")
        if r.get("depends_on"):
            lines.append(f"- applied after: {', '.join(r['depends_on'])}")
        lines.append(f"- `git am -3` alone: {r.get('git_am_3', '')}")
        if r.get("supersession"):
            s = r["supersession"]
            state = "holds" if s["holds"] else "STALE"
            lines.append(f"- known supersession ({state}): {s['change']}")
            lines += [f"  - {c}" for c in s["checks"]]
        if r.get("port"):
            lines.append("- port in the release's format: " + ", ".join(
                f"`{f}` {state}" for f, state in r["port"].items()))
        if r.get("tests"):
            t = r["tests"]
            lines.append(f"- tests on the port: {t['tests']} "
                         f"{t.get('summary', '')}".rstrip())
        lines += [_hunk_line(h) for h in r.get("hunks", [])]
        lines.append(f"- what to do: {r.get('action', '')}")
        lines.append("")
    return "\n".join(lines)


def write_upstream(ws: Workspace, results: list[dict], patches: list[Path],
                   out: Path) -> list[str]:
    """The ported patches (``git format-patch``, in series order, each on
    the pristine release) into ``out`` with their ``series``; returns their
    names. Only the patches and the series file there are replaced."""
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.patch"), out / "series"]:
        old.unlink(missing_ok=True)
    names = []
    for r in results:
        rev = r.get("_port_commit")
        if rev is None:
            continue
        number = r["patch"][:4]
        made = vllm_tree.git(*vllm_tree.FORMAT_PATCH_ARGS,
                             f"--start-number={int(number)}", "-o", str(out),
                             f"{rev}^..{rev}", cwd=ws.tree).split()
        names += [Path(m).name for m in made]
    (out / "series").write_text("".join(f"{n}\n" for n in names))
    return names


def run(ws: Workspace, patches: list[Path], fmt: Formatter | None,
        python: str | None = None) -> list[dict]:
    index = DefIndex(ws)
    results = []
    for i, patch in enumerate(patches, 1):
        result = judge(ws, patch, patches, index, fmt)
        merged = result.pop("_merged", None)
        if result["verdict"] == "applies":
            rev = (commit_port(ws, patch, merged) if merged is not None
                   else vllm_tree.git("rev-parse", "HEAD",
                                      cwd=ws.tree).strip())
            if rev is not None:
                result["_port_commit"] = rev
                if python is not None:
                    vllm_tree.git("checkout", "-q", rev, cwd=ws.tree)
                    result["tests"] = run_port_tests(ws, patch, python)
                    if result["tests"]["tests"] == "fail":
                        result["action"] = (
                            "fix the port first: its tests fail on the "
                            "release (see the error)")
        print(f"[{i}/{len(patches)}] {patch.name}: {result['verdict']}",
              flush=True)
        results.append(result)
    ws.reset()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=os.environ.get("VLLM_VERSION")
                        or None)
    parser.add_argument("--out", type=Path, default=vllm_tree.PATCH_DIR.parent)
    parser.add_argument("--run-tests", action="store_true",
                        help="run each ported patch's tests in a "
                        "python-only environment of the release")
    parser.add_argument("--test-python", default=None,
                        help="the python of that environment (default: a "
                        "venv made under the cache)")
    parser.add_argument("--upstream-dir", type=Path, default=None,
                        help="write the ported patches there")
    parser.add_argument("--series", type=Path, default=vllm_tree.SERIES,
                        help="the series file (default: %(default)s)")
    args = parser.parse_args()
    cache = fetch_vllm_sdist.default_cache_dir()
    version, sdist, sha256 = fetch_sdist(args.version, cache)
    print(f"vLLM {version}: {sdist.name} sha256 {sha256}")
    patches = vllm_tree.series_patches(args.series)
    shown = args.series.resolve()
    if shown.is_relative_to(vllm_tree.ROOT):
        shown = shown.relative_to(vllm_tree.ROOT)
    notes = [f"Series: the {len(patches)} patches of `{shown}`."]
    with tempfile.TemporaryDirectory() as tmp:
        ws = release_workspace(sdist, Path(tmp) / "vllm", patches)
        fmt = ruff_formatter(ws, cache)
        if fmt is None:
            notes.append("The release's pinned ruff could not be had: "
                         "ports were merged unformatted.")
        python = None
        if args.run_tests:
            python, state = (args.test_python, "given") \
                if args.test_python else test_python(ws, version, cache)
            if python is None:
                notes.append(f"Tests not run: {state}.")
        results = run(ws, patches, fmt, python)
        if args.upstream_dir is not None:
            keep = [r for r in results if r.get("_port_commit") and (
                python is None or r.get("tests", {}).get("tests") in (
                    "pass", "none"))]
            names = write_upstream(ws, keep, patches, args.upstream_dir)
            print(f"wrote {len(names)} ported patches to "
                  f"{args.upstream_dir}")
    for r in results:
        r.pop("_port_commit", None)
    report = {"vllm_version": version, "sdist": sdist.name,
              "sha256": sha256, "notes": notes, "patches": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rebase-{version}.json").write_text(
        json.dumps(report, indent=1) + "\n")
    text = table(version, sha256, results, notes)
    (args.out / f"rebase-{version}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
