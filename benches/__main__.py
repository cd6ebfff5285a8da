"""`python -m benches` (`ztunnel-bench`): start the modes, run the matrix, print and save the results.

See benches/README.md for what each figure means and how to read the ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from benches.matrix import BenchError, Matrix, Settings
from benches.report import plot, table, targets_report, write_json
from benches.topology import LoadGenerator, SetupError, Topology


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benches", description="ztunnel load-test harness (loopback only)"
    )
    p.add_argument("--quick", action="store_true", help="one short round (under a minute): a smoke test")
    p.add_argument("--rounds", type=int, help="rounds (default 3; --quick: 1)")
    p.add_argument("--seconds", type=float, help="seconds per rate measurement (default 3; --quick: 0.5)")
    p.add_argument(
        "--hold", type=int, help="idle connections for the memory figure (default 1000; --quick: 300)"
    )
    p.add_argument("--out", type=Path, default=Path("results"), help="results folder (default: results/)")
    p.add_argument(
        "--plot", action="store_true", help="also write latest.png (needs matplotlib: pip install '.[bench]')"
    )
    p.add_argument("--no-stunnel", action="store_true", help="leave out the stunnel anchor")
    p.add_argument("--workers", type=int, help="run every ztunnel with ZTUNNEL_WORKER_THREADS=N")
    p.add_argument(
        "--keep-logs", action="store_true", help="keep the processes' logs (their folder is printed)"
    )
    p.add_argument("--dns", action="store_true", help="only the dns figure (benches/dns.py), vs dnsmasq")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = Settings.quick() if args.quick else Settings()
    overrides = {
        k: v
        for k, v in (("rounds", args.rounds), ("seconds", args.seconds), ("hold", args.hold))
        if v is not None
    }
    if overrides:
        settings = dataclasses.replace(settings, **overrides)
    if settings.rounds < 1 or settings.seconds <= 0 or settings.hold < 1:
        print("benches: --rounds, --seconds and --hold must be positive", file=sys.stderr)
        return 2
    if args.dns:
        from benches.dns import run_figure

        return run_figure(settings.seconds, args.out)
    # Children inherit the limit: 1,000 held connections take four descriptors each along the path.
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="ztunnel-bench-"))
    topo = Topology(workdir, workers=args.workers, with_stunnel=not args.no_stunnel)
    gen: LoadGenerator | None = None
    ok = False
    try:
        modes = topo.start()
        for note in topo.notes:
            print(f"note: {note}")
        print(
            f"modes: {', '.join(m.name for m in modes)} on {topo.net}.0/24; {settings.rounds} round(s), "
            f"{settings.seconds:g}s per rate figure, {settings.hold} idle connections held",
            flush=True,
        )
        gen = LoadGenerator(workdir / "loadgen.log")
        matrix = Matrix(modes, gen, settings, progress=lambda s: print(s, flush=True))
        matrix.run()
        names = [m.name for m in modes]
        data = matrix.to_json()
        summary = data["summary"]
        print()
        print(table(summary, names))
        text, targets = targets_report(summary)
        print()
        print(text)
        data["targets"] = targets
        data["notes"] = topo.notes
        data["workers"] = args.workers
        data["machine"] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
        data["elapsed_s"] = time.monotonic() - started
        path = write_json(args.out, data)
        print(f"\nJSON: {path}")
        if args.plot:
            png = plot(args.out, summary, names)
            print(
                f"chart: {png}"
                if png
                else "chart: skipped, matplotlib is not installed (pip install '.[bench]')"
            )
        for err in matrix.errors:
            print(f"error: {err}", file=sys.stderr)
        ok = not matrix.errors
        print(f"elapsed: {time.monotonic() - started:.0f}s")
    except (SetupError, BenchError) as e:
        print(f"benches: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        print("benches: interrupted", file=sys.stderr)
    finally:
        if gen is not None:
            gen.close()
        topo.stop()
        if args.keep_logs or not ok:
            print(f"logs: {workdir}", file=sys.stderr)
        else:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
