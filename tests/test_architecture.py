"""The layout rules of DESIGN.md §2, read from the source: imports point one way (no circle, type-only
imports included), the model package sees only config, request and batch of the engine side, the kernels
see only themselves and errors, the cache layer and the scheduler never import torch, the server reaches
the cache only through the engine, and no module grows past the ceiling."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvserve"
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module imported anywhere in the file: function-level and TYPE_CHECKING imports too (a
    type-only circle is a circle of meaning, and the next refactor makes it a real one)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    package = module_name(path).rsplit(".", 0 if path.name == "__init__.py" else 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & MODULE_NAMES
            found.update(submodules or {base})
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
MODULE_NAMES = set(MODULES)


def _is_ancestor(package: str, name: str) -> bool:
    """Importing a module always runs its packages' __init__ first: not an edge of its own."""
    return name.startswith(package + ".")


GRAPH = {name: {m for m in imports_of(path) if m in MODULES and m != name and not _is_ancestor(m, name)}
         for name, path in MODULES.items()}


def test_no_import_circle():
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])


def test_the_model_package_sees_only_config_request_sampling_params_batch_and_kernels():
    allowed = {"kvserve", "kvserve.config", "kvserve.request", "kvserve.sampling_params", "kvserve.batch"}
    for name, deps in GRAPH.items():
        if name.startswith("kvserve.model"):
            outside = {d for d in deps if not d.startswith(("kvserve.model", "kvserve.kernels")) and d not in allowed}
            assert not outside, f"{name} imports {sorted(outside)}"


def test_the_kernels_import_nothing_of_kvserve_but_themselves_and_errors():
    """The kernels are the ground floor (the native library and its torch wrappers): an import of the
    model or the engine from here is an arrow back up (a benchmark that needs the model lives in tools/)."""
    for name, path in MODULES.items():
        if name == "kvserve.kernels" or _is_ancestor("kvserve.kernels", name):
            outside = {m for m in imports_of(path) if m.split(".")[0] == "kvserve" and m != "kvserve.errors"
                       and m != "kvserve.kernels" and not _is_ancestor("kvserve.kernels", m)}
            assert not outside, f"{name} imports {sorted(outside)}"


@pytest.mark.parametrize("prefix", ["kvserve.cache", "kvserve.batch", "kvserve.scheduler", "kvserve.config",
                                    "kvserve.request", "kvserve.sampling_params", "kvserve.token_bans"])
def test_the_cache_layer_and_scheduler_import_no_torch(prefix):
    for name, path in MODULES.items():
        if name == prefix or name.startswith(prefix + "."):
            heavy = {m for m in imports_of(path) if m.split(".")[0] in ("torch", "numpy")}
            assert not heavy, f"{name} imports {sorted(heavy)}"
            # nor through another kvserve module
            reach, todo = set(), [name]
            while todo:
                for dep in GRAPH[todo.pop()]:
                    if dep not in reach:
                        reach.add(dep)
                        todo.append(dep)
            assert not any(d.startswith("kvserve.model") for d in reach), f"{name} reaches the model"


def test_no_module_past_the_ceiling():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


# What server/ may import of the cache layer: the chained-hash and namespace rule (the router hashes
# prompts exactly as the engine does) and the KV event wire (until it leaves cache/ for kv_events).
# pure helpers that hold no cache state: namespaces and hashes, the events' schema, the fair-share table
SERVER_CACHE_IMPORTS = {"kvserve.cache.hashing", "kvserve.cache.events", "kvserve.cache.fair_table"}


def test_the_server_reaches_the_cache_only_through_the_engine():
    for name, path in MODULES.items():
        if not name.startswith("kvserve.server"):
            continue
        cache = {m for m in imports_of(path) if m == "kvserve.cache" or m.startswith("kvserve.cache.")}
        assert cache <= SERVER_CACHE_IMPORTS, f"{name} imports {sorted(cache - SERVER_CACHE_IMPORTS)}"
        tree = ast.parse(path.read_text())
        reached = sorted({ast.unparse(node) for node in ast.walk(tree)
                          if isinstance(node, ast.Attribute) and node.attr in ("manager", "scheduler")})
        assert not reached, f"{name} reaches past the engine's API: {reached}"

