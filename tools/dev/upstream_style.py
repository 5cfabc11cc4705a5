"""vLLM's own formatters and linters, at the versions its pre-commit pins,
on the files a patch touches.

Upstream's CI runs ``pre-commit`` (yapf, isort, ruff) on every file a pull
request changes; a patch that fails it is sent back before review. The
versions come from the tree's ``.pre-commit-config.yaml`` and the settings
from its ``pyproject.toml``, so the check follows the base release. The
tools are installed once, with pip, into a directory of their own under the
cache (they must not replace the project's own ruff).
"""

import re
import subprocess
import sys
from pathlib import Path

# pre-commit repository -> the tool it provides.
TOOL_REPOS = {
    "google/yapf": "yapf",
    "PyCQA/isort": "isort",
    "astral-sh/ruff-pre-commit": "ruff",
}
# What the pinned pre-commit hooks leave out (``exclude`` of the yapf hook
# and the file-wide one); isort and ruff read their own from pyproject.toml.
YAPF_EXCLUDE = re.compile(r"^(\.buildkite|benchmarks|build|examples)/")
ALL_EXCLUDE = re.compile(r"^vllm/third_party/")


def pinned_versions(tree: Path) -> dict[str, str]:
    """{tool: version} from the tree's ``.pre-commit-config.yaml``."""
    text = (tree / ".pre-commit-config.yaml").read_text()
    versions = {}
    for repo, tool in TOOL_REPOS.items():
        m = re.search(rf"repo: https://github.com/{re.escape(repo)}\s*\n"
                      r"\s*rev: v?(\S+)", text)
        if m is None:
            raise SystemExit(f"{tree}/.pre-commit-config.yaml pins no {tool}:"
                             " cannot check the series with upstream's tools")
        versions[tool] = m.group(1)
    return versions


def install(versions: dict[str, str], cache: Path) -> Path:
    """A directory holding exactly these versions (pip ``--target``)."""
    tag = "-".join(f"{t}{v}" for t, v in sorted(versions.items()))
    target = cache / f"upstream-style-{tag}"
    if not (target / ".complete").exists():
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--target",
             str(target), *(f"{t}=={v}" for t, v in versions.items())],
            capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit("cannot install vLLM's pinned formatters "
                             f"({versions}): {proc.stderr.strip()[-300:]}")
        (target / ".complete").touch()
    return target


def _run(tools: Path, args: list[str], tree: Path) -> tuple[int, str]:
    env = {"PYTHONPATH": str(tools), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(args, cwd=tree, env=env, capture_output=True,
                          text=True)
    return proc.returncode, proc.stdout + proc.stderr


def problems(tree: Path, files: list[str], tools: Path,
             versions: dict[str, str]) -> list[str]:
    """One line per file a pinned tool would change or flags."""
    files = sorted(f for f in files
                   if f.endswith(".py") and (tree / f).exists()
                   and not ALL_EXCLUDE.match(f))
    if not files:
        return []
    found = []
    yapf_files = [f for f in files if not YAPF_EXCLUDE.match(f)]
    if yapf_files:
        _, out = _run(tools, [sys.executable, "-m", "yapf", "--diff",
                              *yapf_files], tree)
        for f in sorted(set(re.findall(r"^--- (\S+)\s+\(original\)", out,
                                       re.M))):
            found.append(f"{f}: yapf {versions['yapf']} would reformat it")
    _, out = _run(tools, [sys.executable, "-m", "isort", "--check-only",
                          *files], tree)
    for path in re.findall(r"^ERROR: (\S+) Imports are incorrectly", out,
                           re.M):
        rel = Path(path).resolve().relative_to(tree.resolve())
        found.append(f"{rel}: isort {versions['isort']} would sort its "
                     "imports")
    code, out = _run(tools, [str(tools / "bin" / "ruff"), "check",
                             "--output-format", "concise", "--no-cache",
                             *files], tree)
    if code != 0:
        found += [f"{line} (ruff {versions['ruff']})"
                  for line in out.splitlines()
                  if re.match(r"^\S+\.py:\d+:\d+: ", line)]
    return found
