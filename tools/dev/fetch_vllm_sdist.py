"""Fetch the pinned vLLM source distribution into a local cache.

``pip download --no-binary`` cannot fetch vLLM's sdist: pip prepares its
metadata first, vLLM's ``setup.py`` appends a device suffix to the version and
pip then rejects the file as inconsistent. Instead this asks the package index
that pip is configured to use (PEP 691 JSON simple API) for the file by name,
and checks its sha256. A file already in the cache, downloaded earlier or put
there by hand, is used without any network access.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

PROJECT = "vllm"
VERSION = "0.11.0"
FILENAME = f"{PROJECT}-{VERSION}.tar.gz"
SHA256 = "f435a64c24e9c4178d657a76f8edd8548ddc444012f7d06a9f79ac3a6392bfae"


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(os.environ.get("VLLM_ASCEND_CACHE", Path(root) / "vllm-ascend"))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def configured_index_urls() -> list[str]:
    """The index URLs pip itself would use (its config, env, then PyPI)."""
    urls = []
    for key in ("global.index-url", "install.index-url", "download.index-url"):
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", key],
            capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            urls.append(out.stdout.strip())
    if os.environ.get("PIP_INDEX_URL"):
        urls.insert(0, os.environ["PIP_INDEX_URL"])
    if not urls:
        from pip._internal.models.index import PyPI
        urls.append(PyPI.simple_url)
    return [u for u in urls if not u.startswith("file:")]


def find_file_url(index_url: str) -> str:
    req = urllib.request.Request(
        f"{index_url.rstrip('/')}/{PROJECT}/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        listing = json.load(resp)
    for entry in listing.get("files", []):
        if entry["filename"] == FILENAME:
            want = entry.get("hashes", {}).get("sha256")
            if want and want != SHA256:
                raise SystemExit(
                    f"index {index_url} lists {FILENAME} with sha256 {want}, "
                    f"expected {SHA256}: refusing it")
            return entry["url"]
    raise LookupError(f"{FILENAME} is not listed by {index_url}")


def fetch(cache_dir: Path) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / FILENAME
    if target.exists():
        if sha256_of(target) == SHA256:
            return target
        raise SystemExit(
            f"{target} exists but its sha256 is not {SHA256}; delete it and "
            "run again, or put the genuine file there")
    errors = []
    for index_url in configured_index_urls():
        try:
            url = find_file_url(index_url)
        except Exception as exc:  # try the next configured index
            errors.append(f"{index_url}: {exc}")
            continue
        print(f"downloading {FILENAME} ...", file=sys.stderr)
        partial = target.with_suffix(".partial")
        urllib.request.urlretrieve(url, partial)
        got = sha256_of(partial)
        if got != SHA256:
            partial.unlink()
            raise SystemExit(f"downloaded {FILENAME} has sha256 {got}, "
                             f"expected {SHA256}")
        partial.rename(target)
        return target
    raise SystemExit(
        f"could not fetch {FILENAME}: " + "; ".join(errors) +
        f". Offline, place the file at {target}.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    args = parser.parse_args()
    print(fetch(args.cache_dir))


if __name__ == "__main__":
    main()
