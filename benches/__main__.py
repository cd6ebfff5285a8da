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

from benches.capture import CaptureTopology
from benches.matrix import BenchError, Matrix, Settings
from benches.report import plot, table, targets_report, write_json
from benches.soak import SoakSettings, parse_duration, run_soak
from benches.topology import LoadGenerator, Mode, SetupError, Topology, stunnel_handshakes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benches", description="ztunnel load-test harness (loopback or iptables capture)"
    )
    p.add_argument(
        "--topology",
        choices=("loopback", "capture"),
        default="loopback",
        help="loopback: SOCKS5 on 127.x (default); capture (root): network namespaces, iptables REDIRECT "
        "to 15001, C load tools and iperf3",
    )
    p.add_argument("--quick", action="store_true", help="one short round (under a minute): a smoke test")
    p.add_argument("--rounds", type=int, help="rounds (default 3; --quick: 1)")
    p.add_argument("--seconds", type=float, help="seconds per rate measurement (default 3; --quick: 0.5)")
    p.add_argument(
        "--hold", type=int, help="idle connections for the memory figure (default 1000; --quick: 300)"
    )
    p.add_argument(
        "--paced-seconds",
        type=float,
        help="seconds of the paced load per mode and round (capture topology; default 10; --quick: 4)",
    )
    p.add_argument("--out", type=Path, default=Path("results"), help="results folder (default: results/)")
    p.add_argument(
        "--plot", action="store_true", help="also write latest.png (needs matplotlib: pip install '.[bench]')"
    )
    p.add_argument("--no-stunnel", action="store_true", help="leave out the stunnel anchor")
    p.add_argument("--workers", type=int, help="run every ztunnel with ZTUNNEL_WORKER_THREADS=N")
    p.add_argument(
        "--worker-counts",
        default=None,
        help="worker counts of the hbone throughput figures, comma-separated (default 1,2,4; '' for none)",
    )
    p.add_argument(
        "--keep-logs", action="store_true", help="keep the processes' logs (their folder is printed)"
    )
    p.add_argument(
        "--soak",
        type=parse_duration,
        metavar="DURATION",
        help="instead of the matrix: a soak of the hbone mode for DURATION (e.g. 30m, 90s)",
    )
    p.add_argument("--soak-interval", type=parse_duration, help="soak: seconds between samples (default 60s)")
    p.add_argument(
        "--soak-concurrent",
        type=int,
        help="soak: connections held at once in the byte-checked concurrency test first (default 10000)",
    )
    p.add_argument("--soak-idle", type=int, help="soak: idle connections held during the mix (default 1000)")
    p.add_argument("--dns", action="store_true", help="only the dns figure (benches/dns.py), vs dnsmasq")
    return p


def _settings(args: argparse.Namespace) -> Settings | None:
    """The matrix's settings from the options; None (the reason printed) when they are invalid."""
    settings = Settings.quick() if args.quick else Settings()
    overrides = {
        k: v
        for k, v in (
            ("rounds", args.rounds),
            ("seconds", args.seconds),
            ("hold", args.hold),
            ("paced_seconds", args.paced_seconds),
        )
        if v is not None
    }
    if args.worker_counts is not None:
        try:
            overrides["worker_counts"] = tuple(int(n) for n in args.worker_counts.split(",") if n.strip())
        except ValueError:
            print("benches: --worker-counts takes numbers separated by commas", file=sys.stderr)
            return None
    if overrides:
        settings = dataclasses.replace(settings, **overrides)
    if settings.rounds < 1 or settings.seconds <= 0 or settings.hold < 1 or settings.paced_seconds <= 0:
        print("benches: --rounds, --seconds, --hold and --paced-seconds must be positive", file=sys.stderr)
        return None
    return settings


def _raise_nofile() -> None:
    """Children inherit the limit: each held connection takes a descriptor at every end along the
    path, and a proxy process holds both ends of the ones it carries (20,000 of them at
    `--hold 10000`, more than a usual hard limit of 20,000 allows with everything else). Root may
    raise the hard limit too, up to the kernel's `fs.nr_open`."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard
    if os.geteuid() == 0:
        try:
            want = max(hard, min(1 << 18, int(Path("/proc/sys/fs/nr_open").read_text())))
        except (OSError, ValueError):
            pass
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
    except (OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["scale"]:
        from benches.scale import main as scale_main

        return scale_main(argv[1:])
    args = build_parser().parse_args(argv)
    settings = _settings(args)
    if settings is None:
        return 2
    if args.dns:
        from benches.dns import run_figure

        return run_figure(settings.seconds, args.out)
    _raise_nofile()

    if args.topology == "capture" and os.geteuid() != 0:
        print("benches: --topology capture needs root (network namespaces, iptables)", file=sys.stderr)
        return 2

    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="ztunnel-bench-"))
    topo: Topology | CaptureTopology
    if args.topology == "capture":
        topo = CaptureTopology(workdir, workers=args.workers, with_stunnel=not args.no_stunnel)
    else:
        topo = Topology(workdir, workers=args.workers, with_stunnel=not args.no_stunnel)
    gen: LoadGenerator | None = None
    ok = False
    try:
        modes = topo.start()
        for note in topo.notes:
            print(f"note: {note}")
        if args.topology == "loopback":
            gen = LoadGenerator(workdir / "loadgen.log")
            for m in modes:
                m.gen = gen
        if args.soak is not None:
            soak = SoakSettings.from_args(args.soak, args.soak_interval, args.soak_concurrent, args.soak_idle)
            ok = run_soak(topo.name, modes, soak, args.out, progress=lambda s: print(s, flush=True))
            return 0 if ok else 1
        ok = _run_matrix(args, settings, topo, modes, gen, started)
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


def _run_matrix(
    args: argparse.Namespace,
    settings: Settings,
    topo: Topology | CaptureTopology,
    modes: list[Mode],
    gen: LoadGenerator | None,
    started: float,
) -> bool:
    """Run the matrix over the started modes, print and save its results; True when no run failed."""
    paced = (
        f", paced {settings.paced_rate:,.0f}/s of {settings.paced_size} B over "
        f"{settings.paced_connections} connections for {settings.paced_seconds:g}s"
        if isinstance(topo, CaptureTopology)
        else ""
    )
    print(
        f"modes: {', '.join(m.name for m in modes)} ({topo.name}: {topo.where}); {settings.rounds} "
        f"round(s), {settings.seconds:g}s per rate figure, {settings.hold} idle connections held{paced}",
        flush=True,
    )
    matrix = Matrix(
        modes,
        gen,
        settings,
        progress=lambda s: print(s, flush=True),
        set_workers=topo.set_workers,
        workers=args.workers,
    )
    matrix.run()
    names = [m.name for m in modes]
    data = matrix.to_json()
    summary = data["summary"]
    print()
    print(table(summary, names))
    data["notes"] = topo.notes
    data["topology"] = topo.name
    if isinstance(topo, CaptureTopology):
        data["namespaces"] = [ns.name for ns in topo.namespaces]
    data["workers"] = args.workers
    stunnel = next((m for m in modes if m.name == "stunnel"), None)
    server = next((p for p in stunnel.processes if p.name == "stunnel-server"), None) if stunnel else None
    if server is not None:
        counts = stunnel_handshakes(server.log_path)
        data["stunnel_handshakes"] = counts
        print(
            f"\nstunnel server: {counts['connections']:,} TLS connections, {counts['resumed']:,} resumed, "
            f"{counts['full']:,} full handshakes (from its log)"
        )
    text, targets = targets_report(data)
    print()
    print(text)
    data["targets"] = targets
    data["machine"] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    data["elapsed_s"] = time.monotonic() - started
    path = write_json(args.out, data)
    print(f"\nJSON: {path}")
    if args.plot:
        png = plot(args.out, summary, names)
        print(
            f"chart: {png}" if png else "chart: skipped, matplotlib is not installed (pip install '.[bench]')"
        )
    for err in matrix.errors:
        print(f"error: {err}", file=sys.stderr)
    print(f"elapsed: {time.monotonic() - started:.0f}s")
    return not matrix.errors


if __name__ == "__main__":
    raise SystemExit(main())
