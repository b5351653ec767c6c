"""Shared by rprof's benchmarks: start a Ruby workload that waits for "go",
attach a profiler to it, let it run, and read what it reports."""
import glob
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RPROF = os.environ.get(
    "RPROF", os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release/rprof")
)


class EmptySwitchProgram:
    """An empty BPF program on `sched_switch` (`tp_btf`, the hook rprof's
    `wall` uses), attached from `start()` to `stop()`: what the kernel's call into
    any switch program costs, which no switch tracer goes under. Built with
    clang and gcc against the libbpf that building rprof vendored
    (libbpf-sys's output in the cargo target directory, with libelf and
    zlib); `why_not()` says what is missing."""

    PROGRAM = """#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
char LICENSE[] SEC("license") = "GPL";
SEC("tp_btf/sched_switch")
int empty_switch(void *ctx) { return 0; }
"""
    LOADER = """#include <bpf/libbpf.h>
#include <stdio.h>
#include <unistd.h>
int main(int argc, char **argv) {
  struct bpf_object *o = bpf_object__open_file(argv[1], NULL);
  struct bpf_program *p;
  if (!o || bpf_object__load(o)) return 1;
  bpf_object__for_each_program(p, o) if (!bpf_program__attach(p)) return 1;
  printf("attached\\n");
  fflush(stdout);
  pause();
  return 0;
}
"""

    def __init__(self, tmp):
        self.proc = None
        self.problem = None
        target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
        libs = sorted(glob.glob(os.path.join(target, "release/build/libbpf-sys-*/out/libbpf.a")),
                      key=os.path.getmtime)
        if not libs:
            self.problem = f"no libbpf built under {target} (cargo build --release first)"
            return
        out = os.path.dirname(libs[-1])
        include = os.path.join(out, "include")
        prog, loader = os.path.join(tmp, "empty.bpf.c"), os.path.join(tmp, "loader.c")
        with open(prog, "w") as f:
            f.write(self.PROGRAM)
        with open(loader, "w") as f:
            f.write(self.LOADER)
        self.obj, self.exe = os.path.join(tmp, "empty.bpf.o"), os.path.join(tmp, "loader")
        for cmd in (["clang", "-O2", "-g", "-target", "bpf", "-I", os.path.join(ROOT, "bpf"), "-I", include,
                     "-c", prog, "-o", self.obj],
                    ["gcc", "-O2", "-I", include, loader, libs[-1], "-lelf", "-lz", "-o", self.exe]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                self.problem = f"{cmd[0]} failed: {done.stderr.strip()[:200]}"
                return

    def why_not(self):
        return self.problem

    def start(self):
        self.proc = subprocess.Popen([self.exe, self.obj], stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "attached":
            raise RuntimeError("the empty sched_switch program did not attach")

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


class Workload:
    """A Ruby script from bench/ that prints "ready", waits for a line on
    stdin, works, prints its result line and exits."""

    def __init__(self, script, *args, ruby="ruby", prefix=()):
        self.proc = subprocess.Popen(
            [*prefix, ruby, os.path.join(ROOT, "bench", script), *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError(f"{script} did not get ready: {line!r}")
        self.pid = self.proc.pid

    def go(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def result(self):
        """The words of its result line, as a dict of key -> value."""
        line = self.proc.stdout.readline().split()
        self.proc.wait()
        return dict(zip(line[::2], line[1::2]))


class Profiler:
    """A profiler process attached to a workload; `ready_text` on its stderr
    (or a delay) says it is attached."""

    def __init__(self, argv, ready_text=None, delay=0.0):
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if ready_text:
            line = self.proc.stderr.readline()
            if ready_text not in line:
                raise RuntimeError(f"{argv[0]} did not start: {line!r} {self.proc.stderr.read()}")
        if delay:
            time.sleep(delay)

    def finish(self, timeout=120):
        """Waits for the profiler (it stops when the workload exits); returns its stderr."""
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGINT)
            _, err = self.proc.communicate()
        return err


def samples_in(stderr, default):
    """The samples rprof's last line counts ("rprof: N samples, ..."). BPF
    time is divided by these, not by the program's runs: it also runs on
    every tick of a CPU running anything else, returning at once, and how
    many such runs there are depends on where the profiled thread runs."""
    m = re.search(r"rprof: (\d+) samples", stderr or "")
    return int(m.group(1)) if m else default


def cpu_seconds(pid):
    """CPU time `pid` has used so far (user and system), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port():
    """A TCP port on 127.0.0.1 nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def table(rows, headers):
    widths = [max(len(str(r[i])) for r in rows + [headers]) for i in range(len(headers))]
    out = ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths))]
    out.append("  ".join("-" * w for w in widths))
    for r in rows:
        out.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    return "\n".join(out)


def need_root():
    if os.geteuid() != 0:
        sys.exit("benchmarks load BPF programs: run them as root")


def need_tool(name, package):
    """Stops with one line before the runs if `name` is not installed (not
    in the middle of them)."""
    if not shutil.which(name):
        sys.exit(f"this benchmark needs {name}: apt-get install {package}")


class BpfStats:
    """Run time of a process's BPF programs of one type, from the kernel's
    BPF statistics (kernel.bpf_stats_enabled, switched on while in use)."""

    PERF_EVENT = 7
    TRACEPOINT = 5

    def __enter__(self):
        with open("/proc/sys/kernel/bpf_stats_enabled") as f:
            self.old = f.read().strip()
        with open("/proc/sys/kernel/bpf_stats_enabled", "w") as f:
            f.write("1")
        return self

    def __exit__(self, *exc):
        with open("/proc/sys/kernel/bpf_stats_enabled", "w") as f:
            f.write(self.old)

    @staticmethod
    def _programs(pid):
        """The fdinfo of each BPF program `pid` holds, as a dict."""
        fd_dir = f"/proc/{pid}/fdinfo"
        for fd in os.listdir(fd_dir):
            try:
                with open(os.path.join(fd_dir, fd)) as f:
                    info = dict(l.split(":", 1) for l in f.read().splitlines() if ":" in l)
            except OSError:
                continue
            if "prog_id" in info:
                yield {k: v.strip() for k, v in info.items()}

    @staticmethod
    def by_program(pid):
        """{program name: (nanoseconds, runs)} of `pid`'s BPF programs (names
        from one `bpftool prog show`: Debian 12's cannot show some programs
        by id, iterators and tracing programs)."""
        shown = subprocess.run(["bpftool", "prog", "show", "--json"], capture_output=True, text=True)
        names = {str(p["id"]): p.get("name", "") for p in json.loads(shown.stdout or "[]")}
        out = {}
        for info in BpfStats._programs(pid):
            name = names.get(info["prog_id"])
            if name is None:
                continue
            ns, runs = out.get(name, (0, 0))
            out[name] = (ns + int(info.get("run_time_ns", "0")), runs + int(info.get("run_cnt", "0")))
        return out

    @staticmethod
    def read(pid, prog_type):
        """(nanoseconds, events) of `pid`'s BPF programs of `prog_type`: the
        time of all of them, and the runs of the one that runs at every event
        (rprof --native continues an event in a second program, by tail call,
        so one event is two runs)."""
        ns = runs = 0
        for info in BpfStats._programs(pid):
            if info.get("prog_type") == str(prog_type):
                ns += int(info.get("run_time_ns", "0"))
                runs = max(runs, int(info.get("run_cnt", "0")))
        return ns, runs
