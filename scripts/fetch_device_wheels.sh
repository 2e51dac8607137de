#!/usr/bin/env bash
# The wheels the GPU machine lacks, for its Python 3.12, fetched here (it reaches no registry):
# .whl/ for the engine, the benches and the gpu-marked tests; .whl-gw/ for the gateway-curve stage's
# web process (Django and what its settings import), kept apart because with Django importable the
# tests stage's conftest asks for a database; .whl-bnb/ for bench/qlora.py's bitsandbytes row
# (docs/quantized-bases.md), alone for its size. The folders are git-ignored (.git/info/exclude) and
# travel with a device call's `carry`; docs/benchmarks.md says how each stage installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.whl-gw/' .git/info/exclude 2>/dev/null || echo '/.whl-gw/' >> .git/info/exclude
grep -qx '/.whl-bnb/' .git/info/exclude 2>/dev/null || echo '/.whl-bnb/' >> .git/info/exclude
platforms=()
for tag in manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
fetch() {  # fetch FOLDER REQUIREMENTS
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$1" -r "$2"
}
fetch .whl scripts/device-wheels.txt
fetch .whl-gw scripts/device-wheels-gateway.txt
fetch .whl-bnb scripts/device-wheels-bnb.txt
du -sh .whl .whl-gw .whl-bnb
