"""Every torch_npu / torch.npu call site in the plugin was reached in CI.

The double records each call by the plugin line it came from (in the test
process and in every engine it starts). This runs last and compares that
record with the call sites found in the plugin's source: a site that no
test reached is an NPU code path CI never ran.
"""

import ast
from pathlib import Path

import pytest

from tests.utils.npu import REAL_NPU, trace_path

PLUGIN = Path(__file__).resolve().parents[2] / "vllm_ascend"
# The tests that drive the NPU paths; without them the record is partial.
EXERCISERS = ("test_npu_engine.py", "test_npu.py", "test_npu_attention.py",
              "test_worker_memory.py")


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def plugin_call_sites() -> set[str]:
    sites = set()
    for path in sorted(PLUGIN.rglob("*.py")):
        rel = path.relative_to(PLUGIN.parent)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = _dotted(node.func)
                if name.startswith(("torch_npu.", "torch.npu.")):
                    sites.add(f"{rel}:{node.lineno}:{name}")
    return sites


def test_call_sites_are_found():
    sites = plugin_call_sites()
    names = {site.rsplit(":", 1)[1] for site in sites}
    assert {"torch_npu.npu_fused_infer_attention_score.out",
            "torch_npu.npu_grouped_matmul", "torch.npu.mem_get_info",
            "torch.npu.set_device"} <= names


@pytest.mark.skipif(REAL_NPU, reason="the real torch_npu records nothing")
def test_every_npu_call_site_was_reached(request):
    ran = {item.fspath.basename for item in request.session.items}
    partial = [name for name in EXERCISERS if name not in ran]
    if partial:
        pytest.skip(f"run the whole suite: {partial} did not run")
    reached = set(Path(trace_path()).read_text().split())
    missing = sorted(plugin_call_sites() - reached)
    assert not missing, ("NPU call sites no test reached:\n" +
                         "\n".join(missing))


def test_production_never_imports_the_double():
    for path in sorted(PLUGIN.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [
                    getattr(node, "module", None) or ""]
                assert not any(n.startswith("tests") for n in names), path
