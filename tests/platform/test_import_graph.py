"""The plugin's import graph: no circle between modules, none between its
folders (so no import runs back up), no test instrument and no
``unittest.mock`` in the product.

Every import statement counts, function-local and ``TYPE_CHECKING`` ones
included: a circle dodged by importing late is still a circle to a reader.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_ascend"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The modules (or packages) one file imports, absolute names."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) -
                                           node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            # ``from package import module``
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        name: {i for i in _imports(path) if i in modules and i != name}
        for name, path in modules.items()
    }


def _cycle(edges: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph, or []."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def _room(module: str) -> str:
    """A module's folder under the package (``ops``, ``worker``, ...); a
    top-level module (device, envs, checks, platform) is a room of its
    own."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()):
        return parts[1]
    return module


def test_no_module_circle(graph):
    # A package's __init__ re-exporting its own modules is not a circle.
    edges = {m: {i for i in deps if not m.startswith(i + ".")}
             for m, deps in graph.items()}
    assert _cycle(edges) == []


def test_no_folder_circle(graph):
    """Folders and top-level modules form a hierarchy: ``ops`` never
    imports ``distributed`` while ``distributed`` imports ``ops``, and no
    leaf (device, envs) imports the folders that use it."""
    rooms: dict[str, set[str]] = {}
    for module, deps in graph.items():
        src = _room(module)
        rooms.setdefault(src, set()).update(
            _room(d) for d in deps if _room(d) != src)
    # The package's __init__ only names the entry points.
    rooms.pop("vllm_ascend", None)
    assert _cycle(rooms) == []


def test_product_imports_no_test_instrument():
    for path in PACKAGE.rglob("*.py"):
        imports = _imports(path)
        assert not {i for i in imports
                    if i == "tests" or i.startswith("tests.")}, path
        assert not {i for i in imports if i.startswith("unittest")}, path
