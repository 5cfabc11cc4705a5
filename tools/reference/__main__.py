"""CLI of the offline GLM-4.5 + MTP reference; prints acceptance as JSON.

    python -m tools.reference --model-dir tests/fixtures/tiny-glm45 \
        --k 1 2 3 --max-new-tokens 48

Prompts default to the checkpoint's ``heldout_prompts.json``; ``--prompts``
takes a JSON file holding a list of token-id lists or of objects with
``token_ids``. The library is the package: ``from tools.reference import
Glm45Reference, measure_acceptance``.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import torch

from tools.reference import Glm45Reference, measure_acceptance

__all__ = ["Glm45Reference", "load_prompts", "measure_acceptance"]


def load_prompts(path: Path) -> list[list[int]]:
    """Token-id prompts from a JSON list of lists or of {"token_ids": ...}."""
    if not path.exists():
        raise SystemExit(f"prompts file {path} does not exist; pass "
                         "--prompts with a JSON list of token-id lists")
    data = json.loads(path.read_text())
    if isinstance(data, dict) and "prompts" in data:
        data = data["prompts"]
    prompts = [p["token_ids"] if isinstance(p, dict) else p for p in data]
    if not prompts or not all(
            isinstance(p, list) and p and all(isinstance(t, int) for t in p)
            for p in prompts):
        raise SystemExit(f"{path}: expected a non-empty list of non-empty "
                         "token-id lists (or objects with 'token_ids')")
    return prompts


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.reference", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, default=None,
                        help="default: <model-dir>/heldout_prompts.json")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, nargs="+", default=[1],
                        help="draft tokens per step (one run per value)")
    parser.add_argument("--outputs", action="store_true",
                        help="include the generated token ids")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; the model is tiny, more threads "
                        "only contend on a shared CPU")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts
                           or args.model_dir / "heldout_prompts.json")
    ref = Glm45Reference(args.model_dir)
    results = []
    for k in args.k:
        r = measure_acceptance(args.model_dir, prompts, args.max_new_tokens,
                               k, reference=ref)
        if not args.outputs:
            r.pop("outputs")
        results.append(r)
    print(json.dumps(results if len(results) > 1 else results[0], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
