"""Run an llmserve service under a profiler (its event loop's thread), writing the profile
when the service stops (`llmserve.cli` runs the exit handlers before it leaves, so
`python -m cProfile` would never get to write its file):

    .venv/bin/python bench/profile_service.py /tmp/scheduler.prof scheduler --port 50071
    .venv/bin/python -c "import pstats; pstats.Stats('/tmp/scheduler.prof').sort_stats('tottime').print_stats(30)"

cProfile times every call, which inflates code made of many small calls several times
over. `--sample` instead samples the stack of the event loop's thread every millisecond of
the process's CPU time (`SIGPROF`) and writes, per function, the share of samples it was
running in itself and the share it was on the stack (time in C code, protobuf's or gRPC's,
counts for the Python function that called it):

    .venv/bin/python bench/profile_service.py --sample /tmp/scheduler.txt scheduler ...
"""

from __future__ import annotations

import atexit
import cProfile
import runpy
import signal
import sys
from collections import Counter
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

INTERVAL_S = 0.001


class StackSampler:
    """Counts, on each SIGPROF, the function running and every function on its stack."""

    def __init__(self) -> None:
        self.own: Counter[str] = Counter()
        self.on_stack: Counter[str] = Counter()
        self.num_samples = 0

    def start(self) -> None:
        signal.signal(signal.SIGPROF, self._sample)
        signal.setitimer(signal.ITIMER_PROF, INTERVAL_S, INTERVAL_S)

    def _sample(self, signum: int, frame: FrameType | None) -> None:
        self.num_samples += 1
        seen: set[str] = set()
        first = True
        while frame is not None:
            code = frame.f_code
            key = f"{code.co_filename}:{code.co_firstlineno}({code.co_name})"
            if first:
                self.own[key] += 1
                first = False
            if key not in seen:
                seen.add(key)
                self.on_stack[key] += 1
            frame = frame.f_back

    def dump(self, out: str, limit: int = 60) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        n = max(self.num_samples, 1)
        lines = [f"{self.num_samples} samples, one per {INTERVAL_S * 1e3:g} ms of CPU"]
        for title, counts in (("own", self.own), ("on the stack", self.on_stack)):
            lines.append(f"\n-- by {title}: % of samples")
            for key, count in counts.most_common(limit):
                lines.append(f"{100 * count / n:6.2f}  {key}")
        Path(out).write_text("\n".join(lines) + "\n")


def _dump_cprofile(profiler: cProfile.Profile, out: str) -> None:
    profiler.disable()
    profiler.dump_stats(out)


if __name__ == "__main__":
    args = sys.argv[1:]
    sample = args[0] == "--sample"
    if sample:
        args = args[1:]
    out = args[0]
    sys.argv = ["llmserve", *args[1:]]
    if sample:
        sampler = StackSampler()
        atexit.register(sampler.dump, out)
        sampler.start()
    else:
        profiler = cProfile.Profile()
        atexit.register(_dump_cprofile, profiler, out)
        profiler.enable()
    runpy.run_module("llmserve.cli", run_name="__main__")
