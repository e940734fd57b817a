#!/usr/bin/env bash
# Installs everything dsakit needs to build and test on a fresh Debian 12 / Ubuntu 24.04 machine.
# Debian packages pinned by name (the distribution pins the version); Python packages pinned
# exactly in scripts/requirements.txt. Idempotent: skips what is already there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

debs=(cmake ninja-build g++ pkg-config
      libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev libfmt-dev nlohmann-json3-dev
      libopenblas-dev libomp-dev clang libclang-rt-dev python3-venv python3-dev)

missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[install-deps] apt-get install ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Python tools for the independent cross-checks (numpy + ml_dtypes) and the build of the Python
# package (nanobind + scikit-build-core, docs/python.md), in a venv inside the checkout.
venv="$here/../.venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import numpy, ml_dtypes, pytest, matplotlib, nanobind, scikit_build_core" \
    2>/dev/null; then
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$here/requirements.txt"
fi
echo "[install-deps] ok"
