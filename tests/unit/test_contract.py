"""The shape of the tree: what the client may import, and no import cycles.

``ckpt_client`` may use only the names the shared modules export (``__all__`` of
``ckptd.protocol``, ``ckptd.checksum``, ``ckptd.knobs``), never the daemon's internals;
and no two modules of ``ckptd`` or ``ckpt_client`` import each other, directly or around
a loop. Read from the source with ``ast``, so the test sees lazy imports too.
"""

from __future__ import annotations

import ast
import importlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED = ("ckptd.protocol", "ckptd.checksum", "ckptd.knobs")


def modules_of(package: str) -> dict[str, str]:
    """Module name -> file, for every module of a package."""
    found = {}
    base = os.path.join(ROOT, package)
    for directory, _, names in os.walk(base):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[module.removesuffix(".__init__")] = path
    return found


def imports_of(path: str) -> list[tuple[str, list[str]]]:
    """(module, names) for every ``import`` / ``from ... import`` in a file."""
    tree = ast.parse(open(path).read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
    return found


ALL = {**modules_of("ckptd"), **modules_of("ckpt_client")}


def test_the_client_uses_only_exported_names_of_the_shared_modules():
    wrong = []
    for module, path in modules_of("ckpt_client").items():
        for imported, names in imports_of(path):
            if not imported.startswith("ckptd"):
                continue
            if imported == "ckptd":
                wrong += [f"{module}: ckptd.{n}" for n in names if f"ckptd.{n}" not in SHARED]
                continue
            if imported not in SHARED:
                wrong.append(f"{module} imports daemon internals: {imported}")
                continue
            exported = set(importlib.import_module(imported).__all__)
            wrong += [f"{module}: {imported}.{n} is not exported" for n in names
                      if n not in exported]
    assert not wrong, "\n".join(wrong)


def test_attribute_uses_of_the_shared_modules_in_the_client_are_exported():
    wrong = []
    for module, path in modules_of("ckpt_client").items():
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in ("protocol", "checksum", "knobs")):
                exported = importlib.import_module(f"ckptd.{node.value.id}").__all__
                if node.attr not in exported:
                    wrong.append(f"{module}: {node.value.id}.{node.attr}")
    assert not wrong, "\n".join(sorted(set(wrong)))


@pytest.mark.parametrize("shared", SHARED)
def test_shared_modules_export_what_they_define(shared):
    module = importlib.import_module(shared)
    assert all(hasattr(module, name) for name in module.__all__)


def _graph() -> dict[str, set]:
    graph = {}
    for module, path in ALL.items():
        edges = set()
        for imported, names in imports_of(path):
            for candidate in [imported] + [f"{imported}.{n}" for n in names]:
                if candidate in ALL and candidate != module:
                    edges.add(candidate)
        graph[module] = edges
    return graph


def test_no_import_cycles_between_modules():
    graph, state, cycles = _graph(), {}, []

    def visit(node, stack):
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target, stack + [target])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    # a package __init__ importing its own modules is not a cycle worth reporting
    assert not cycles, "\n".join(cycles)


def test_ckptd_status_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, ckptd.cli, ckptd.status; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
