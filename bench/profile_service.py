"""Run an llmserve service under cProfile (its event loop's thread), writing the profile when
the service stops (`llmserve.cli` runs the exit handlers before it leaves, so
`python -m cProfile` would never get to write its file):

    .venv/bin/python bench/profile_service.py /tmp/scheduler.prof scheduler --port 50071
    .venv/bin/python -c "import pstats; pstats.Stats('/tmp/scheduler.prof').sort_stats('tottime').print_stats(30)"
"""

from __future__ import annotations

import atexit
import cProfile
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _dump(profiler: cProfile.Profile, out: str) -> None:
    profiler.disable()
    profiler.dump_stats(out)


if __name__ == "__main__":
    out = sys.argv[1]
    sys.argv = ["llmserve", *sys.argv[2:]]
    profiler = cProfile.Profile()
    atexit.register(_dump, profiler, out)
    profiler.enable()
    runpy.run_module("llmserve.cli", run_name="__main__")
