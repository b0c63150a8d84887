"""Which framework versions each adapter supports, and the check every adapter runs first.

The ranges are the ones CI installs and tests (``pyproject.toml``'s extras name the same
ones); an adapter imported beside a version outside them refuses with the installed
version, the range, and the command that installs a tested one, instead of failing later
inside a private API that moved.
"""

from __future__ import annotations

import importlib.metadata

#: distribution -> (lowest supported, first unsupported), as in pyproject.toml's extras.
#: CI tests the newest release of each range that installs beside torch 2.13.0.
SUPPORTED = {
    "lightning": ("2.6", "2.7"),
    "torchtitan": ("0.3", "0.4"),
    "transformers": ("5.0", "6"),
    "accelerate": ("1.10", "2"),
}

#: The extra of ``ckptd`` that installs each distribution.
EXTRA = {"lightning": "lightning", "torchtitan": "torchtitan", "transformers": "hf",
         "accelerate": "hf"}


class UnsupportedFrameworkError(ImportError):
    """A framework is missing, or installed in a version the adapter was not tested with."""


def check_version(distribution: str, installed: str | None) -> None:
    """Refuse ``installed`` (``None``: not installed) unless it is in the supported range.

    Raises
    ------
    UnsupportedFrameworkError
        Naming the distribution, the installed version, the range and the fix.
    """
    from packaging.version import Version  # every supported framework depends on it

    low, high = SUPPORTED[distribution]
    fix = (f"install a tested one: pip install 'ckptd[{EXTRA[distribution]}]' "
           f"(or pip install '{distribution}>={low},<{high}')")
    if installed is None:
        raise UnsupportedFrameworkError(
            f"ckpt_client.integrations needs {distribution}, which is not installed; {fix}")
    if not Version(low) <= Version(installed) < Version(high):
        raise UnsupportedFrameworkError(
            f"{distribution} {installed} is outside the range ckpt_client.integrations "
            f"supports and CI tests (>={low},<{high}); {fix}")


def require(distribution: str) -> str:
    """Check the installed ``distribution`` (see :func:`check_version`); its version."""
    try:
        installed = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        installed = None
    check_version(distribution, installed)
    return installed
