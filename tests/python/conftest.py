"""Fixtures for the Python cross-checks: the probe executable (the seed: tests/conftest.py)."""
import pathlib

import pytest


@pytest.fixture(scope="session")
def probe(build_file) -> pathlib.Path:
    """Path of dsakit_formats_probe in $DSAKIT_BUILD_DIR (default: build/)."""
    return build_file("tests/dsakit_formats_probe", "dsakit_formats_probe")
