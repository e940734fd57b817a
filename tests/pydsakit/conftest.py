"""Fixtures for the tests of the Python package (docs/python.md#tests).

Which dsakit they import, in order:
  DSAKIT_WHEEL_DIR   a folder with one dsakit wheel (scripts/test.sh builds it CPU-only): it is
                     installed (no dependencies) into a folder of this session and imported from
                     there, so the tests run the wheel as a user gets it, built once;
  DSAKIT_PYTHON_DIR  a CMake build tree's package folder (<build>/python, -DDSAKIT_PYTHON=ON);
  otherwise          the dsakit the interpreter finds (pip install .).
DSAKIT_BUILD_DIR (default build/) holds the dsakit CLI the layer is compared with.
"""
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
_SITE = None


def _install_wheel(wheel_dir: str) -> str:
    wheels = sorted(pathlib.Path(wheel_dir).glob("dsakit-*.whl"))
    if len(wheels) != 1:
        raise pytest.UsageError(f"DSAKIT_WHEEL_DIR={wheel_dir}: expected one dsakit wheel, "
                                f"found {[w.name for w in wheels]}")
    site = tempfile.mkdtemp(prefix="dsakit-site-")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--disable-pip-version-check", "--target", site, str(wheels[0])], check=True)
    return site


def pytest_configure(config):
    global _SITE
    if os.environ.get("DSAKIT_WHEEL_DIR"):
        _SITE = _install_wheel(os.environ["DSAKIT_WHEEL_DIR"])
        sys.path.insert(0, _SITE)
    elif os.environ.get("DSAKIT_PYTHON_DIR"):
        p = pathlib.Path(os.environ["DSAKIT_PYTHON_DIR"])
        sys.path.insert(0, str(p if p.is_absolute() else REPO / p))
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU, a CUDA build and torch")


def pytest_report_header(config):
    try:
        import dsakit
        return (f"dsakit {dsakit.__version__} from {pathlib.Path(dsakit.__file__).parent}, "
                f"cuda compiled: {dsakit.cuda_compiled()}, GPUs: {dsakit.cuda_device_count()}")
    except Exception as e:  # pragma: no cover - reported, then the tests fail on import
        return f"dsakit not importable: {e}"


@pytest.fixture(scope="session")
def wheel_site():
    """The folder the wheel was installed into (None when not testing a wheel)."""
    return _SITE


@pytest.fixture(scope="session")
def cli(build_file) -> pathlib.Path:
    return build_file("bin/dsakit", "dsakit_cli")
