"""No module in ckptd/ or ckpt_client/ over 450 lines, no class over 250.

A module that outgrows one screenful per concern hides several owners, and a class that
long does more than one job: both are split by concern before they grow further. Counted
with ``ast`` (a class from its ``class`` line, decorators included, to its last line).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ckptd", "ckpt_client")
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 250


def modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def long_classes(path: Path) -> list[str]:
    """``name (lines)`` of every class in ``path`` longer than its limit."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = node.end_lineno - first + 1
            if length > MAX_CLASS_LINES:
                found.append(f"{node.name} ({length} lines)")
    return found


def test_the_packages_are_found():
    assert len(modules()) > 50, "the size check read no modules: is ROOT right?"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_and_classes_are_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, (
        f"{path.relative_to(ROOT)} has {lines} lines (limit {MAX_MODULE_LINES}): split it "
        f"by concern, each new module's docstring saying what it owns")
    assert long_classes(path) == [], (
        f"{path.relative_to(ROOT)}: classes over {MAX_CLASS_LINES} lines: "
        f"{long_classes(path)}; give each one job")


def test_the_check_can_fail(tmp_path):
    long_class = tmp_path / "big.py"
    long_class.write_text("class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES)
    assert long_classes(long_class) == [f"Big ({MAX_CLASS_LINES + 1} lines)"]
