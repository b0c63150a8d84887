"""Allowed roots: what the daemon may write."""

import os

import pytest

from ckptd.storage.roots import AllowedRoots, PathRefusedError


@pytest.fixture
def roots(tmp_path):
    (tmp_path / "ckpt").mkdir()
    return AllowedRoots.of([tmp_path / "ckpt"])


def test_paths_inside_a_root_are_accepted(roots, tmp_path):
    assert roots.check(str(tmp_path / "ckpt" / "step1" / "model.pt")) == \
        os.path.realpath(tmp_path / "ckpt" / "step1" / "model.pt")


@pytest.mark.parametrize("make_path, reason", [
    (lambda t: str(t / "elsewhere.pt"), "outside the allowed roots"),
    (lambda t: str(t / "ckpt" / ".." / "escape.pt"), "contains '..'"),
    (lambda t: "relative/model.pt", "not absolute"),
    (lambda t: "", "empty"),
    (lambda t: str(t / "ckpt" / "a\x00b"), "NUL"),
])
def test_unsafe_paths_are_refused(roots, tmp_path, make_path, reason):
    with pytest.raises(PathRefusedError, match=reason):
        roots.check(make_path(tmp_path))


def test_a_symlink_escaping_the_root_is_refused(roots, tmp_path):
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "ckpt" / "link")
    with pytest.raises(PathRefusedError, match="resolves to"):
        roots.check(str(tmp_path / "ckpt" / "link" / "model.pt"))


def test_a_sibling_with_a_common_prefix_is_not_inside(roots, tmp_path):
    (tmp_path / "ckpt-other").mkdir()
    with pytest.raises(PathRefusedError):
        roots.check(str(tmp_path / "ckpt-other" / "m.pt"))
