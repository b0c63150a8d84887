"""The shape of the tree: what the client may import, and no import cycles.

``ckpt_client`` may use only the names the shared modules export (``__all__`` of
``ckptd.protocol`` and its modules, ``ckptd.checksum``, ``ckptd.knobs``,
``ckptd.aligned_mapping``: how both ends map the pool), never the
daemon's internals; and no two modules of ``ckptd`` or ``ckpt_client`` import each other,
directly or around a loop. A package's ``__init__`` may import its own modules (that is
how a package face re-exports names); its modules then must not import the face back.
Read from the source with ``ast``, so the test sees lazy imports too.
"""

from __future__ import annotations

import ast
import importlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED = ("ckptd.protocol", "ckptd.checksum", "ckptd.knobs", "ckptd.aligned_mapping")


def is_shared(module: str) -> bool:
    """Whether the client may import ``module``: a shared module or a module of one."""
    return any(module == s or module.startswith(s + ".") for s in SHARED)


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
            if not is_shared(imported):
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


SHARED_MODULES = sorted(m for m in ALL if is_shared(m))


@pytest.mark.parametrize("shared", SHARED_MODULES)
def test_shared_modules_export_what_they_define(shared):
    module = importlib.import_module(shared)
    assert all(hasattr(module, name) for name in module.__all__)


def test_the_protocol_face_keeps_every_name_of_its_modules():
    """``from ckptd.protocol import X`` works for every name a protocol module exports."""
    import ckptd.protocol as face

    missing = [f"{m}.{n}" for m in SHARED_MODULES if m.startswith("ckptd.protocol.")
               for n in importlib.import_module(m).__all__ if not hasattr(face, n)]
    assert not missing, "\n".join(missing)


def test_modules_of_a_package_do_not_import_its_face():
    """A package face imports its modules; a module importing the face back would run
    against a half-initialised package."""
    wrong = []
    for module, path in ALL.items():
        if path.endswith("__init__.py"):
            continue
        package = module.rpartition(".")[0]
        if not (package in ALL and ALL[package].endswith("__init__.py")):
            continue
        if not any(m.startswith(package + ".") for m in _graph_edges(ALL[package])):
            continue  # a face that imports none of its modules may be imported freely
        for imported, names in imports_of(path):
            if imported == package and not all(f"{package}.{n}" in ALL for n in names):
                wrong.append(f"{module} imports its package face {package}")
    assert not wrong, "\n".join(wrong)


def _graph_edges(path: str) -> set:
    edges = set()
    for imported, names in imports_of(path):
        edges |= {c for c in [imported] + [f"{imported}.{n}" for n in names] if c in ALL}
    return edges


def _graph() -> dict[str, set]:
    return {module: _graph_edges(path) - {module} for module, path in ALL.items()}


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
    assert not cycles, "\n".join(cycles)


def test_ckptd_status_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, ckptd.cli, ckptd.status; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
