"""zmqtransport.__version__ is the version pyproject.toml declares, and CHANGELOG.md has a section for it."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

import zmqtransport

ROOT = Path(__file__).resolve().parent.parent


def declared_version() -> str:
    # tomllib is 3.11+; the [project] table's version line is all this needs.
    text = (ROOT / "pyproject.toml").read_text()
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]
    match = re.search(r'^version\s*=\s*"([^"]+)"', project, re.MULTILINE)
    assert match, "pyproject.toml's [project] table has no version"
    return match.group(1)


def test_version_is_the_one_pyproject_declares() -> None:
    assert zmqtransport.__version__ == declared_version()


def test_the_installed_distribution_agrees() -> None:
    try:
        installed = metadata.version("zmqtransport")
    except metadata.PackageNotFoundError:
        pytest.skip("zmqtransport is not installed (run from a checkout on PYTHONPATH)")
    site = Path(str(metadata.distribution("zmqtransport").locate_file(""))).resolve()
    if not Path(zmqtransport.__file__).resolve().is_relative_to(site):
        pytest.skip("the zmqtransport imported is not the installed one")
    assert installed == zmqtransport.__version__


def test_the_changelog_has_a_section_for_this_version() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(zmqtransport.__version__)}\b", changelog, re.MULTILINE)
