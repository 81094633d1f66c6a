"""Print pyproject.toml's dependencies (and those of the named extras), one per line.

scripts/install.sh installs them before the project itself, so an image can install its
dependencies from pyproject.toml alone, in a layer that source changes do not invalidate.
"""

from __future__ import annotations

import sys
import tomllib


def requirements(pyproject: str, extras: list[str]) -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [name for name in extras if name not in optional]
    if unknown:
        raise SystemExit(f"unknown extras {unknown}; pyproject.toml has {sorted(optional)}")
    return [*project["dependencies"], *(dep for name in extras for dep in optional[name])]


if __name__ == "__main__":
    names = [name for name in (sys.argv[2] if len(sys.argv) > 2 else "").split(",") if name]
    print("\n".join(requirements(sys.argv[1], names)))
