"""Fixtures of every Python test folder (tests/python, tests/cli, tests/pydsakit): a fresh,
printed seed and the build tree's executables."""
import os
import pathlib
import secrets

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator with a fresh seed per test (DSAKIT_TEST_SEED replays one), printed on failure."""
    seed = int(os.environ.get("DSAKIT_TEST_SEED", secrets.randbits(63)))
    print(f"{request.node.name}: seed {seed} (replay with DSAKIT_TEST_SEED={seed})")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def build_file():
    """build_file(relative, target) -> the path of a built file in $DSAKIT_BUILD_DIR (default
    build/); the test fails naming the CMake target to build when it is missing."""

    def find(relative: str, target: str) -> pathlib.Path:
        build = pathlib.Path(os.environ.get("DSAKIT_BUILD_DIR", "build"))
        path = (build if build.is_absolute() else REPO / build) / relative
        if not path.exists():
            pytest.fail(f"{path} not found: build the target {target} or set DSAKIT_BUILD_DIR")
        return path

    return find
