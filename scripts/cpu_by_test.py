"""Where a test run's CPU goes: each process's CPU time, counted to the test that started it.

    python scripts/cpu_by_test.py build/cpu.json -- make test

Runs the command with this file loaded into every pytest process as a plugin (``-p cpu_by_test`` in
``PYTEST_ADDOPTS``), which writes the test each pytest process is running to a file; meanwhile it
samples ``/proc`` twice a second and counts each process's new CPU time (user + system) to the test of
its nearest pytest ancestor: an engine's server, its EngineCore and workers, a notebook's kernel,
chromium. ``time make test`` cannot see this: it counts only the children that were waited for,
and an isolated engine's processes end in a process group of their own (for one ``make test``,
``time`` said 21 min of CPU where this sampler counted 27). Prints the CPU by test file, by test and by kind of
process, and the lowest MemAvailable seen; writes all of it to the JSON file. Linux only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

_DIR_ENV = "CPU_BY_TEST_DIR"


# ------------------------------------------------------------------ the pytest plugin (in each pytest process)

try:
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        d = os.environ.get(_DIR_ENV)
        if d:
            with open(os.path.join(d, str(os.getpid())), "w") as f:
                f.write(item.nodeid)
        yield
        if d:
            with open(os.path.join(d, str(os.getpid())), "w") as f:
                f.write("(between tests)")
except ImportError:  # the sampler side needs no pytest
    pass


# ------------------------------------------------------------------ the sampler

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
KINDS = ("chromium", "ipykernel", "jupyterlab", "mkdocs", "nnvllm.engine.server", "spawn_main", "pytest", "-c ")


def _kind(cmd: str) -> str:
    if "exec(eval(sys.stdin.readline()))" in cmd:
        return "pytest worker"
    for k in KINDS:
        if k in cmd:
            return {"spawn_main": "vLLM engine process (spawned)", "-c ": "python -c"}.get(k, k)
    return cmd.split(" ")[0].rsplit("/", 1)[-1] or "(kernel thread)"


def _stat(pid: str):
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / _HZ, rest[19]  # ppid, cpu s, start time


class Sampler(threading.Thread):
    def __init__(self, cur_dir: str, period: float = 0.5):
        super().__init__(daemon=True)
        self.cur_dir, self.period = cur_dir, period
        self.stop = threading.Event()
        self.by_test: Counter = Counter()
        self.by_test_kind: Counter = Counter()
        self.by_kind: Counter = Counter()
        self.min_avail_gib = float("inf")
        self._last: dict = {}
        self._cmd: dict = {}

    def _sample(self, count: bool) -> None:
        cur = {}
        for name in os.listdir(self.cur_dir):
            try:
                with open(os.path.join(self.cur_dir, name)) as f:
                    cur[int(name)] = f.read()
            except (OSError, ValueError):
                pass
        parent, cpu = {}, {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                pp, c, start = _stat(pid)
            except (OSError, IndexError, ValueError):
                continue
            parent[int(pid)], cpu[(int(pid), start)] = pp, c
        me = os.getpid()
        for key, c in cpu.items():
            pid = key[0]
            if pid == me:
                continue
            if key not in self._cmd:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        self._cmd[key] = f.read().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    self._cmd[key] = ""
            d = c - self._last.get(key, 0.0)
            self._last[key] = c
            if not count or d <= 0:
                continue
            q, test = pid, "(no test)"
            while q in parent:
                if q in cur:
                    test = cur[q]
                    break
                q = parent[q]
            kind = _kind(self._cmd[key])
            self.by_test[test] += d
            self.by_test_kind[f"{test} || {kind}"] += d
            self.by_kind[kind] += d
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable"):
                    self.min_avail_gib = min(self.min_avail_gib, int(line.split()[1]) / 2**20)

    def run(self) -> None:
        self._sample(count=False)  # what ran before the command is not counted
        while not self.stop.wait(self.period):
            self._sample(count=True)
        self._sample(count=True)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out, cmd = argv[0], argv[2:]
    with tempfile.TemporaryDirectory(prefix="cpu-by-test-") as cur_dir:
        here = os.path.dirname(os.path.abspath(__file__))
        env = {**os.environ, _DIR_ENV: cur_dir,
               "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])),
               "PYTEST_ADDOPTS": " ".join(filter(None, [os.environ.get("PYTEST_ADDOPTS"), "-p cpu_by_test"]))}
        sampler = Sampler(cur_dir)
        sampler.start()
        t0 = time.monotonic()
        rc = subprocess.call(cmd, env=env)
        wall = time.monotonic() - t0
        sampler.stop.set()
        sampler.join()
    total = sum(sampler.by_test.values())
    by_file: Counter = Counter()
    for test, s in sampler.by_test.items():
        by_file[test.split("::", 1)[0]] += s
    report = {"command": cmd, "rc": rc, "wall_s": round(wall, 1), "cpu_s": round(total, 1),
              "min_mem_available_gib": round(sampler.min_avail_gib, 2),
              "by_file": dict(by_file.most_common()), "by_kind": dict(sampler.by_kind.most_common()),
              "by_test": dict(sampler.by_test.most_common()),
              "by_test_and_kind": dict(sampler.by_test_kind.most_common())}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{' '.join(cmd)}: exit {rc}, {wall:.0f} s wall, {total:.0f} s CPU "
          f"({total / wall:.2f} cores), lowest MemAvailable {sampler.min_avail_gib:.1f} GiB")
    for title, table, n in (("by test file", by_file, 25), ("by kind of process", sampler.by_kind, 10)):
        print(f"CPU s {title}:")
        for k, s in table.most_common(n):
            print(f"  {s:7.1f}  {k}")
    print(f"(all of it in {out})")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
