#!/usr/bin/env bash
# Run here, before a device call: copies the golden peer files (../shared/testdata/peers, which
# the device machine cannot see) into .peers/, ignored by git, so the call can carry them:
#   tools/device-prepare.sh     then     run(command="bash tools/device-check.sh", carry=[".peers"])
set -euo pipefail
cd "$(dirname "$0")/.."
src=${DSAKIT_PEERS_DIR:-../shared/testdata/peers}
[ -d "$src" ] || { echo "device-prepare: $src not found" >&2; exit 1; }
rm -rf .peers && cp -r "$src" .peers
mkdir -p .git/info && { grep -qx '/.peers/' .git/info/exclude 2>/dev/null || echo '/.peers/' >>.git/info/exclude; }
echo "device-prepare: $(du -sh .peers | cut -f1) of golden files in .peers/ (carry it)"
