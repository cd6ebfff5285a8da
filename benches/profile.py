"""`python -m benches.profile`: profiles of the proxies while the load generator runs one test.

    python -m benches.profile --mode hbone --test throughput_1 --seconds 5
    python -m benches.profile --topology capture --mode hbone --test paced --seconds 8
    python -m benches.profile --topology capture --mode hbone --test paced --profiler strace

starts the same topology as `python -m benches`, warms the path up, then records every process of
the mode with `py-spy record` (raw collapsed stacks, idle frames left out) while the test runs, and
prints for each process the functions with the most samples, self and inclusive. The raw stacks
stay in the output folder (`--out`, default `results/profile/`) for a flame graph tool. With
`--profiler perf`, native symbols instead; with `--profiler strace`, `strace -c`'s count of each
system call, and the calls per operation of the test (a request, a connection, a round trip).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benches.capture import CaptureTopology
from benches.topology import LoadGenerator, Mode, Topology

TESTS = {
    "throughput_1": ("throughput", {"streams": 1}),
    "throughput_8": ("throughput", {"streams": 8}),
    "rr": ("rr", {"max_count": 10_000_000}),
    "connrate": ("connrate", {"concurrency": 8, "max_count": 10_000_000}),
    "handshake": ("connrate", {"concurrency": 8, "max_count": 10_000_000}),
    # The published load of the matrix's paced figure: 1,000 requests/s of 1 KB over 4 connections.
    "paced": ("paced", {"rate": 1000, "connections": 4, "size": 1024}),
}


def summarize(raw: Path, top: int) -> str:
    self_count: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n_s = line.rpartition(" ")
        if not n_s.isdigit():
            continue
        n = int(n_s)
        total += n
        frames = [
            f.split(" (")[0] + " " + f.split(" (")[1].split(":")[0].rsplit("/", 1)[-1] if " (" in f else f
            for f in stack.split(";")
        ]
        self_count[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    if not total:
        return "  (no samples)"
    out = [f"  {total} samples; self:"]
    out += [f"    {100 * n / total:5.1f}%  {f}" for f, n in self_count.most_common(top)]
    out.append("  inclusive:")
    out += [f"    {100 * n / total:5.1f}%  {f}" for f, n in incl.most_common(top)]
    return "\n".join(out)


def summarize_perf(data: Path, top: int) -> str:
    """The symbols with the most samples (self), with the shared object each is in."""
    report = subprocess.run(
        ["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", "dso,sym", "-g", "none"],
        capture_output=True,
        text=True,
        check=False,
    )
    rows = [line for line in report.stdout.splitlines() if line.strip() and not line.startswith("#")]
    return (
        "\n".join("  " + line.strip() for line in rows[:top]) or f"  (perf report: {report.stderr.strip()})"
    )


def summarize_strace(table: Path, top: int, operations: int) -> str:
    """`strace -c`'s rows with the most calls, each with its calls per operation of the test."""
    rows = []
    for line in table.read_text().splitlines():
        fields = line.split()
        # % time, seconds, usecs/call, calls, [errors,] syscall
        if len(fields) >= 5 and fields[0][0].isdigit() and fields[3].isdigit() and fields[-1] != "total":
            rows.append((int(fields[3]), fields[-1]))
    rows.sort(reverse=True)
    if not rows:
        return "  (strace counted no call)"
    total = sum(n for n, _ in rows)
    per = f", {total / operations:.2f} per operation" if operations else ""
    out = [f"  {total} calls{per}:"]
    for n, name in rows[:top]:
        out.append(f"    {n:8d}  {name}" + (f"  ({n / operations:.2f} per operation)" if operations else ""))
    return "\n".join(out)


def _operations(result: dict[str, object]) -> int:
    """How many operations (requests, connections, round trips) the test's result counts: its
    `count`; 0 for a throughput test, which counts bytes."""
    value = result.get("count")
    return value if isinstance(value, int) and value > 0 else 0


def _record(args: argparse.Namespace, pyspy: str, pid: int, out_file: Path) -> subprocess.Popen[bytes]:
    seconds = str(int(args.seconds + 2))
    if args.profiler == "perf":
        cmd = ["perf", "record", "-F", str(args.rate), "-g", "-p", str(pid), "-o", str(out_file)]
        cmd += ["--", "sleep", seconds]
    elif args.profiler == "strace":
        # Every thread, counted; `timeout` ends it with SIGINT, on which strace writes the table.
        cmd = ["timeout", "-s", "INT", seconds, "strace", "-c", "-f", "-p", str(pid), "-o", str(out_file)]
    else:
        cmd = [pyspy, "record", "-p", str(pid), "-r", str(args.rate), "-d", seconds]
        cmd += ["-f", "raw", "-o", str(out_file), "--nonblocking"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benches.profile")
    p.add_argument(
        "--topology",
        default="loopback",
        choices=["loopback", "capture"],
        help="as `python -m benches`: SOCKS5 on loopback, or (root) iptables capture between namespaces",
    )
    p.add_argument("--mode", default="hbone", choices=["tcp", "hbone", "stunnel"])
    p.add_argument("--test", default="throughput_1", choices=sorted(TESTS))
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument(
        "--profiler",
        default="py-spy",
        choices=["py-spy", "perf", "strace"],
        help="py-spy: Python stacks (the compiled modules and uvloop show as their Python caller); "
        "perf: native symbols, the compiled modules', OpenSSL's, the kernel's; "
        "strace: the system calls, counted",
    )
    p.add_argument("--rate", type=int, default=250, help="samples per second")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--workers", type=int)
    p.add_argument("--out", type=Path, default=Path("results/profile"))
    args = p.parse_args(argv)
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    workdir = Path(tempfile.mkdtemp(prefix="ztunnel-profile-"))
    topo: Topology | CaptureTopology
    if args.topology == "capture":
        topo = CaptureTopology(workdir, workers=args.workers, with_stunnel=args.mode == "stunnel")
    else:
        topo = Topology(workdir, workers=args.workers, with_stunnel=args.mode == "stunnel")
    own: LoadGenerator | None = None
    try:
        modes = {m.name: m for m in topo.start()}
        mode: Mode = modes[args.mode]
        gen = mode.gen  # the capture topology's, inside the client namespace
        if gen is None:
            gen = own = LoadGenerator(workdir / "loadgen.log")
        cmd, extra = TESTS[args.test]
        entry = mode.fresh_entry if args.test == "handshake" and mode.fresh_entry else mode.entry
        warm = gen.call(cmd, entry=entry, seconds=0.5, **extra)
        if "error" in warm:
            print(f"warm-up failed: {warm['error']}", file=sys.stderr)
            return 1
        args.out.mkdir(parents=True, exist_ok=True)
        spies = []
        for proc in mode.processes:
            for pid in proc.pids():
                stem = args.out / f"{args.mode}-{args.test}-{proc.name}-{pid}"
                suffix = {"perf": ".perf.data", "strace": ".strace.txt"}.get(args.profiler, ".txt")
                out_file = stem.with_suffix(suffix)
                spies.append((f"{proc.name} (pid {pid})", out_file, _record(args, pyspy, pid, out_file)))
        time.sleep(1.0)  # the profilers attach
        result = gen.call(cmd, entry=entry, seconds=args.seconds, **extra)
        print({k: v for k, v in result.items() if not isinstance(v, list)})
        for name, out_file, spy in spies:
            spy.wait(timeout=args.seconds + 30)
            print(f"\n{name}: {out_file}")
            if not out_file.exists():
                print("  (the profiler wrote nothing: not a Python process?)")
            elif args.profiler == "perf":
                print(summarize_perf(out_file, args.top))
            elif args.profiler == "strace":
                print(summarize_strace(out_file, args.top, _operations(result)))
            else:
                print(summarize(out_file, args.top))
    finally:
        if own is not None:
            own.close()
        topo.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
