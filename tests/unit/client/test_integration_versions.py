"""The framework version check every adapter runs on import."""

import pytest

from ckpt_client.integrations.versions import SUPPORTED, UnsupportedFrameworkError, check_version


@pytest.mark.parametrize("distribution", sorted(SUPPORTED))
def test_the_range_bounds(distribution):
    low, high = SUPPORTED[distribution]
    check_version(distribution, low)  # the lowest supported passes
    with pytest.raises(UnsupportedFrameworkError) as caught:
        check_version(distribution, high)
    message = str(caught.value)
    assert f"{distribution} {high}" in message and f">={low},<{high}" in message
    assert "pip install 'ckptd[" in message


def test_an_older_release_is_refused_with_the_fix():
    with pytest.raises(UnsupportedFrameworkError, match=r"lightning 2\.1\.0 is outside .*pip install 'ckptd\[lightning\]'"):
        check_version("lightning", "2.1.0")


def test_a_missing_framework_names_the_extra():
    with pytest.raises(UnsupportedFrameworkError, match=r"needs torchtitan, which is not installed.*ckptd\[torchtitan\]"):
        check_version("torchtitan", None)


def test_the_extras_pin_the_same_ranges():
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    with open(os.path.join(root, "pyproject.toml")) as f:
        text = f.read()
    for distribution, (low, high) in SUPPORTED.items():
        assert re.search(rf'"{distribution}>={re.escape(low)},<{re.escape(high)}"', text), distribution
