"""`python -m benches.profile`: py-spy profiles of the proxies while the load generator runs one test.

    python -m benches.profile --mode hbone --test throughput_1 --seconds 5

starts the same topology as `python -m benches`, warms the path up, then records every process of
the mode with `py-spy record` (raw collapsed stacks, idle frames left out) while the test runs, and
prints for each process the functions with the most samples, self and inclusive. The raw stacks
stay in the output folder (`--out`, default `results/profile/`) for a flame graph tool.
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

from benches.topology import LoadGenerator, Mode, Topology

TESTS = {
    "throughput_1": ("throughput", {"streams": 1}),
    "throughput_8": ("throughput", {"streams": 8}),
    "rr": ("rr", {"max_count": 10_000_000}),
    "connrate": ("connrate", {"concurrency": 8, "max_count": 10_000_000}),
    "handshake": ("connrate", {"concurrency": 8, "max_count": 10_000_000}),
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benches.profile")
    p.add_argument("--mode", default="hbone", choices=["tcp", "hbone", "stunnel"])
    p.add_argument("--test", default="throughput_1", choices=sorted(TESTS))
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--workers", type=int)
    p.add_argument("--out", type=Path, default=Path("results/profile"))
    args = p.parse_args(argv)
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    workdir = Path(tempfile.mkdtemp(prefix="ztunnel-profile-"))
    topo = Topology(workdir, workers=args.workers, with_stunnel=args.mode == "stunnel")
    gen = None
    try:
        modes = {m.name: m for m in topo.start()}
        mode: Mode = modes[args.mode]
        gen = LoadGenerator(workdir / "loadgen.log")
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
                raw = args.out / f"{args.mode}-{args.test}-{proc.name}-{pid}.txt"
                spies.append(
                    (
                        f"{proc.name} (pid {pid})",
                        raw,
                        subprocess.Popen(
                            [
                                pyspy,
                                "record",
                                "-p",
                                str(pid),
                                "-r",
                                str(args.rate),
                                "-d",
                                str(int(args.seconds + 2)),
                                "-f",
                                "raw",
                                "-o",
                                str(raw),
                                "--nonblocking",
                            ],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                        ),
                    )
                )
        time.sleep(1.0)  # py-spy attaches
        result = gen.call(cmd, entry=entry, seconds=args.seconds, **extra)
        print({k: v for k, v in result.items() if not isinstance(v, list)})
        for name, raw, spy in spies:
            spy.wait(timeout=args.seconds + 30)
            print(f"\n{name}: {raw}")
            print(
                summarize(raw, args.top)
                if raw.exists()
                else "  (py-spy wrote nothing: not a Python process?)"
            )
    finally:
        if gen is not None:
            gen.close()
        topo.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
