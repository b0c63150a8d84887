"""Knobs: read when used, overridable by environment and in-process, with clear errors."""

import pytest

from ckptd import knobs


def test_a_knob_follows_the_environment_when_read(monkeypatch):
    monkeypatch.delenv("CKPTD_PEER_TIMEOUT", raising=False)
    assert knobs.PEER_TIMEOUT.get() == 30.0
    monkeypatch.setenv("CKPTD_PEER_TIMEOUT", "2.5")
    assert knobs.PEER_TIMEOUT.get() == 2.5


def test_override_wins_inside_its_block_only(monkeypatch):
    monkeypatch.setenv("CKPTD_STAGE_TIMEOUT", "9")
    with knobs.override(STAGE_TIMEOUT=1.0):
        assert knobs.STAGE_TIMEOUT.get() == 1.0
        with knobs.override(STAGE_TIMEOUT=2.0):
            assert knobs.STAGE_TIMEOUT.get() == 2.0
        assert knobs.STAGE_TIMEOUT.get() == 1.0
    assert knobs.STAGE_TIMEOUT.get() == 9.0
    with pytest.raises(KeyError, match="NO_SUCH"):
        with knobs.override(NO_SUCH=1):
            pass


def test_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("CKPTD_WRITERS", "two")
    with pytest.raises(ValueError, match="CKPTD_WRITERS='two' is invalid"):
        knobs.WRITERS.get()
    monkeypatch.setenv("CKPTD_AUTO_START", "maybe")
    with pytest.raises(ValueError, match="CKPTD_AUTO_START"):
        knobs.AUTO_START.get()


def test_legacy_environment_names_still_work(monkeypatch):
    monkeypatch.setenv("CKPTD_ROOTS", "/a:/b")
    monkeypatch.setenv("CKPTD_REPLICATION_WINDOW", "4")
    assert knobs.AUTO_ROOTS.get() == "/a:/b" and knobs.REPLICATION_WINDOW.get() == 4


@pytest.mark.parametrize("text,size", [("512M", 512 << 20), ("2G", 2 << 30), ("1.5GiB", 3 << 29),
                                       ("4096", 4096), ("64k", 64 << 10)])
def test_sizes_parse(text, size):
    assert knobs.parse_size(text) == size


def test_every_knob_is_documented():
    assert all(k.doc and (k.env is None or k.env.startswith("CKPTD_")) for k in knobs.all_knobs())


def test_the_operator_docs_list_every_knob():
    import os

    docs = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "operations.md")).read()
    assert knobs.markdown_table() in docs, \
        "docs/operations.md's table of tunables is stale: python -m ckptd.knobs prints it"
