#!/bin/bash
# Download the wheels tools/gpu/wheels.txt says a GPU session carries into .whl/ (ignored by git; name it in the
# device tool's carry). Run here, where the package index is reachable; the GPU machine is offline.
set -eu
cd "$(dirname "$0")/../.."
mkdir -p .whl
grep -q '^/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
platforms=""
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
    platforms="$platforms --platform ${tag}_x86_64"
done
awk '$1 == "carry" {print $2}' tools/gpu/wheels.txt | while read -r requirement; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms \
        -d .whl "$requirement"
done
du -sh .whl
