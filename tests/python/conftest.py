"""Fixtures for the Python cross-checks: the probe executable and a fresh, printed seed."""
import os
import pathlib
import secrets

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def probe() -> pathlib.Path:
    """Path of dsakit_formats_probe in $DSAKIT_BUILD_DIR (default: build/)."""
    build = pathlib.Path(os.environ.get("DSAKIT_BUILD_DIR", "build"))
    if not build.is_absolute():
        build = REPO / build
    path = build / "tests" / "dsakit_formats_probe"
    if not path.exists():
        pytest.fail(f"{path} not found: build the target dsakit_formats_probe or set DSAKIT_BUILD_DIR")
    return path


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator with a fresh seed per test (DSAKIT_TEST_SEED replays one), printed on failure."""
    seed = int(os.environ.get("DSAKIT_TEST_SEED", secrets.randbits(63)))
    print(f"{request.node.name}: seed {seed} (replay with DSAKIT_TEST_SEED={seed})")
    return np.random.default_rng(seed)
