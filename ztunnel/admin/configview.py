"""`ztunnel config`: the operator's view of a running proxy, for hosts without istioctl.

The subcommands, their aliases, flags, columns, row order and filters are those of `istioctl
ztunnel-config` (`workload`, `service`, `policy`, `certificate`, `connections`, `log`, `all`); what
picks the proxy is its admin address (the positional argument, `[host][:port]`, default
`localhost` and `--proxy-admin-port`) instead of a pod. The tables are read from `GET /config_dump`
and aligned as Go's tabwriter aligns istioctl's; `-o json|yaml` prints the proxy's own entries of the
section (every field it dumps), filtered and sorted as the table. `log` posts to `/logging`.

Only the standard library's HTTP client: the command runs where the proxy runs, without a venv of
tools. Rendering is pure (`render` takes the dump and the options, returns the text).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

DEFAULT_HOST = "localhost"
DEFAULT_ADMIN_PORT = 15000
TIMEOUT = 10.0
OUTPUTS = ("short", "json", "yaml")

# The levels `istioctl ztunnel-config log --level` accepts, and how the proxy spells each.
LOG_LEVELS: Mapping[str, str] = {
    "trace": "trace",
    "debug": "debug",
    "info": "info",
    "warning": "warn",
    "warn": "warn",
    "error": "error",
    "critical": "error",
    "off": "off",
}


class ConfigViewError(Exception):
    """What went wrong, in one line for the operator."""


Dump = Mapping[str, Any]
Entry = Mapping[str, Any]


# --- tables ------------------------------------------------------------------------------------


def table(rows: Sequence[Sequence[object]], padding: int = 1) -> str:
    """Cells aligned in columns as Go's `tabwriter` (minwidth 0, padding `padding`, spaces) aligns
    rows of equal length: each column but the last as wide as its widest cell plus the padding."""
    cells = [[_text(c) for c in row] for row in rows]
    if not cells:
        return ""
    widths = [max(len(row[i]) for row in cells) + padding for i in range(len(cells[0]) - 1)]
    lines = []
    for row in cells:
        lines.append("".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + row[-1])
    return "\n".join(lines) + "\n"


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _entries(section: Any) -> list[Entry]:
    """A section as a list: the proxy dumps lists; a map of entries (older dumps) reads as its values."""
    if section is None:
        return []
    if isinstance(section, Mapping):
        return list(section.values())
    if isinstance(section, list):
        return section
    raise ConfigViewError(f"unexpected config dump section: {type(section).__name__}")


def _str(entry: Entry, key: str) -> str:
    value = entry.get(key)
    return "" if value is None else str(value)


def _fold(a: str, b: str) -> bool:
    return a.casefold() == b.casefold()


# --- workloads ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadFilter:
    address: str = ""
    node: str = ""
    namespace: str = ""

    def __call__(self, w: Entry) -> bool:
        if self.namespace and not _fold(_str(w, "namespace"), self.namespace):
            return False
        if self.address and not any(_fold(ip, self.address) for ip in w.get("workloadIps") or ()):
            return False
        return not (self.node and not _fold(_str(w, "node"), self.node))


def _waypoint_name(gateway: Entry | None, services: list[Entry]) -> str:
    """The service a waypoint address names (by `namespace/hostname` or by VIP); None: no waypoint."""
    if not gateway:
        return "None"
    destination = _str(gateway, "destination")
    for svc in services:
        if f"{_str(svc, 'namespace')}/{_str(svc, 'hostname')}" == destination:
            return _str(svc, "name")
        if destination in (svc.get("vips") or ()):
            return _str(svc, "name")
    return "NA"


def workloads(dump: Dump, flt: WorkloadFilter) -> list[Entry]:
    return [w for w in _entries(dump.get("workloads")) if flt(w)]


def workload_table(dump: Dump, flt: WorkloadFilter) -> str:
    services = _entries(dump.get("services"))
    chosen = sorted(
        workloads(dump, flt), key=lambda w: (f"{_str(w, 'namespace')}.{_str(w, 'name')}", _str(w, "node"))
    )
    rows: list[list[object]] = [["NAMESPACE", "POD NAME", "ADDRESS", "NODE", "WAYPOINT", "PROTOCOL"]]
    for w in chosen:
        address = ",".join(w.get("workloadIps") or ()) or _str(w, "hostname")
        waypoint = _waypoint_name(w.get("waypoint"), services)
        rows.append(
            [_str(w, "namespace"), _str(w, "name"), address, _str(w, "node"), waypoint, _str(w, "protocol")]
        )
    return table(rows)


# --- services and policies ---------------------------------------------------------------------


def services(dump: Dump, namespace: str) -> list[Entry]:
    chosen = [
        s for s in _entries(dump.get("services")) if not namespace or _fold(_str(s, "namespace"), namespace)
    ]
    return sorted(chosen, key=lambda s: (_str(s, "namespace"), _str(s, "name"), _str(s, "hostname")))


def service_table(dump: Dump, namespace: str) -> str:
    all_services = _entries(dump.get("services"))
    by_uid = {_str(w, "uid"): w for w in _entries(dump.get("workloads"))}
    rows: list[list[object]] = [["NAMESPACE", "SERVICE NAME", "SERVICE VIP", "WAYPOINT", "ENDPOINTS"]]
    for svc in services(dump, namespace):
        vips = ",".join(vip.partition("/")[2] for vip in svc.get("vips") or ())
        endpoints = _entries(svc.get("endpoints"))
        healthy = sum(
            1 for ep in endpoints if _str(by_uid.get(_str(ep, "workloadUid"), {}), "status") == "Healthy"
        )
        waypoint = _waypoint_name(svc.get("waypoint"), all_services)
        rows.append(
            [_str(svc, "namespace"), _str(svc, "name"), vips, waypoint, f"{healthy}/{len(endpoints)}"]
        )
    return table(rows)


def policies(dump: Dump, namespace: str) -> list[Entry]:
    chosen = [
        p for p in _entries(dump.get("policies")) if not namespace or _fold(_str(p, "namespace"), namespace)
    ]
    return sorted(chosen, key=lambda p: (_str(p, "namespace"), _str(p, "name")))


def policy_table(dump: Dump, namespace: str) -> str:
    rows: list[list[object]] = [["NAMESPACE", "POLICY NAME", "ACTION", "SCOPE"]]
    rows += [
        [_str(p, "namespace"), _str(p, "name"), _str(p, "action"), _str(p, "scope")]
        for p in policies(dump, namespace)
    ]
    return table(rows)


# --- certificates ------------------------------------------------------------------------------


def _parse_time(text: str) -> datetime | None:
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


def _valid(cert: Entry, now: datetime) -> bool:
    start, end = _parse_time(_str(cert, "validFrom")), _parse_time(_str(cert, "expirationTime"))
    return start is not None and end is not None and start < now < end


def _serial(cert: Entry) -> str:
    """The decimal serial number the proxy dumps, in hex as istioctl prints it."""
    text = _str(cert, "serialNumber")
    return format(int(text), "x") if text.isdigit() else text or "NA"


def certificate_table(dump: Dump, now: datetime) -> str:
    rows: list[list[object]] = [
        ["CERTIFICATE NAME", "TYPE", "STATUS", "VALID CERT", "SERIAL NUMBER", "NOT AFTER", "NOT BEFORE"]
    ]
    for secret in _entries(dump.get("certificates")):
        identity, state = _str(secret, "identity"), _str(secret, "state")
        if "Unavailable" in state:
            state = "Unavailable"
        chain, roots = list(secret.get("certChain") or ()), list(secret.get("rootCerts") or ())
        if not chain:
            rows.append([identity, "NA", state, False, "NA", "NA", "NA"])
            continue
        for i, cert in enumerate(chain):
            # Dumps of old put the root last in the chain and had no `rootCerts`.
            kind = "Leaf" if i == 0 else "Root" if i == len(chain) - 1 and not roots else "Intermediate"
            rows.append(_cert_row(identity, kind, state, cert, now))
        rows += [_cert_row(identity, "Root", state, cert, now) for cert in roots]
    return table(rows, padding=5)


def _cert_row(identity: str, kind: str, state: str, cert: Entry, now: datetime) -> list[object]:
    not_after, not_before = _str(cert, "expirationTime") or "NA", _str(cert, "validFrom") or "NA"
    return [identity, kind, state, _valid(cert, now), _serial(cert), not_after, not_before]


# --- connections -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConnectionsFilter:
    namespace: str = ""
    direction: str = ""  # inbound, outbound or both
    raw: bool = False
    workload: str = ""  # a pod's name, or name.namespace

    def normalized(self) -> ConnectionsFilter:
        if self.workload and not self.namespace and "." in self.workload:
            name, _, namespace = self.workload.partition(".")
            return ConnectionsFilter(namespace, self.direction, self.raw, name)
        return self

    def __call__(self, state: Entry) -> bool:
        info = state.get("info") or {}
        if self.namespace and self.namespace != _str(info, "namespace"):
            return False
        return not (self.workload and not _fold(self.workload, _str(info, "name")))


def workload_states(dump: Dump, flt: ConnectionsFilter) -> list[Entry]:
    flt = flt.normalized()
    states = [s for s in _entries(dump.get("workloadState")) if flt(s)]
    return sorted(
        states, key=lambda s: (_str(s.get("info") or {}, "namespace"), _str(s.get("info") or {}, "name"))
    )


def _split_host_port(addr: str) -> tuple[str, str] | None:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        return None
    if host.startswith("["):
        return (host[1:-1], port) if host.endswith("]") else None
    return None if ":" in host else (host, port)


def _join_host_port(host: str, port: str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _namer(dump: Dump, raw: bool) -> Callable[[str], str]:
    """`ip:port` as `name:port`: a service's hostname by its first VIP, else a workload's
    `name.namespace` by its first IP; unknown addresses (and `--raw`) as they are."""
    names: dict[str, str] = {}
    for w in _entries(dump.get("workloads")):
        ips = w.get("workloadIps") or ()
        names[ips[0] if ips else "None"] = f"{_str(w, 'name')}.{_str(w, 'namespace')}"
    for s in _entries(dump.get("services")):
        vips = s.get("vips") or ()
        names[(vips[0].partition("/")[2] if vips else "") or "None"] = _str(s, "hostname")

    def name(addr: str) -> str:
        split = None if raw else _split_host_port(addr)
        if split is None or split[0] not in names:
            return addr
        return _join_host_port(names[split[0]], split[1])

    return name


def connection_table(dump: Dump, flt: ConnectionsFilter) -> str:
    flt = flt.normalized()
    name = _namer(dump, flt.raw)
    rows: list[list[object]] = [["WORKLOAD", "DIRECTION", "LOCAL", "REMOTE", "REMOTE TARGET", "PROTOCOL"]]
    for state in workload_states(dump, flt):
        info = state.get("info") or {}
        pod = f"{_str(info, 'name')}.{_str(info, 'namespace')}"
        conns = state.get("connections") or {}
        if flt.direction != "outbound":
            for c in conns.get("inbound") or ():
                rows.append(
                    [
                        pod,
                        "Inbound",
                        name(_str(c, "actualDst")),
                        name(_str(c, "src")),
                        _str(c, "originalDst"),
                        _str(c, "protocol"),
                    ]
                )
        if flt.direction != "inbound":
            for c in conns.get("outbound") or ():
                rows.append(
                    [
                        pod,
                        "Outbound",
                        name(_str(c, "src")),
                        name(_str(c, "actualDst")),
                        name(_str(c, "originalDst")),
                        _str(c, "protocol"),
                    ]
                )
    return table(rows)


# --- all ---------------------------------------------------------------------------------------


def full_summary(dump: Dump, with_headers: bool, now: datetime) -> str:
    parts = [
        ("WORKLOAD INFO", workload_table(dump, WorkloadFilter())),
        ("SERVICE INFO", service_table(dump, "")),
        ("POLICY INFO", policy_table(dump, "")),
        ("SECRET INFO", certificate_table(dump, now)),
        ("CONNECTIONS INFO", connection_table(dump, ConnectionsFilter())),
    ]
    return "".join(
        "\n" + (f"------ {title} ------\n\n" if with_headers else "") + text for title, text in parts
    )


# --- rendering ---------------------------------------------------------------------------------


def structured(value: Any, output: str) -> str:
    """`-o json` (indented by four, as istioctl) or `-o yaml` (keys sorted, as istioctl's)."""
    if output == "yaml":
        import yaml  # loaded by every `ztunnel` command (its arguments): PyYAML only to print YAML

        return yaml.safe_dump(value, default_flow_style=False, sort_keys=True, allow_unicode=True)
    return json.dumps(value, indent=4, ensure_ascii=False) + "\n"


def render(view: str, dump: Dump, args: argparse.Namespace, now: datetime | None = None) -> str:
    """The text `ztunnel config <view>` prints for this dump."""
    now = now or datetime.now(UTC)
    short = args.output == "short"
    if view == "workload":
        flt = WorkloadFilter(args.address, args.workload_node, args.workload_namespace)
        return workload_table(dump, flt) if short else structured(workloads(dump, flt), args.output)
    if view == "service":
        ns = args.service_namespace
        return service_table(dump, ns) if short else structured(services(dump, ns), args.output)
    if view == "policy":
        ns = args.policy_namespace
        return policy_table(dump, ns) if short else structured(policies(dump, ns), args.output)
    if view == "certificate":
        return (
            certificate_table(dump, now)
            if short
            else structured(_entries(dump.get("certificates")), args.output)
        )
    if view == "connections":
        cf = ConnectionsFilter(args.workload_namespace, args.direction, args.raw)
        return connection_table(dump, cf) if short else structured(workload_states(dump, cf), args.output)
    if view == "all":
        return full_summary(dump, args.with_headers, now) if short else structured(dict(dump), args.output)
    raise ConfigViewError(f"unknown view {view!r}")


# --- the admin server --------------------------------------------------------------------------


def admin_url(address: str | None, port: int) -> str:
    """`http://host:port` from `[host][:port]` (`[v6]:port` too) or a full `http://` URL."""
    text = (address or "").strip()
    if text.startswith(("http://", "https://")):
        return text.rstrip("/")
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        given = rest[1:] if rest.startswith(":") else ""
        if rest and not rest.startswith(":"):
            raise ConfigViewError(f"invalid admin address {address!r}: expected [host]:port")
    elif text.count(":") == 1:
        host, _, given = text.partition(":")
    else:
        host, given = text, ""  # a bare IPv6 address, a name or nothing
    if given and not (given.isdigit() and 0 < int(given) < 65536):
        raise ConfigViewError(f"invalid admin address {address!r}: the port must be 1-65535")
    host = host or DEFAULT_HOST
    return f"http://{f'[{host}]' if ':' in host else host}:{given or port}"


def _request(url: str, method: str) -> str:
    import urllib.error  # with urllib.request (HTTP, e-mail, SSL): only for the request itself
    import urllib.request

    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            return str(response.read().decode("utf-8", errors="replace"))
    except urllib.error.HTTPError as e:
        body = e.read().decode("utf-8", errors="replace").strip()
        raise ConfigViewError(f"{method} {url}: {e.code}: {body}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ConfigViewError(f"cannot reach the admin server at {url}: {reason}") from None


def fetch_dump(base: str) -> dict[str, Any]:
    return _parse_dump(_request(f"{base}/config_dump", "GET"), f"{base}/config_dump")


def read_dump(path: str) -> dict[str, Any]:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigViewError(f"cannot read {path}: {e.strerror}") from None
    return _parse_dump(text, path)


def _parse_dump(text: str, where: str) -> dict[str, Any]:
    try:
        dump = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigViewError(f"{where}: not a config dump (invalid JSON: {e})") from None
    if not isinstance(dump, dict):
        raise ConfigViewError(f"{where}: not a config dump (a JSON {type(dump).__name__}, not an object)")
    return dump


def log_query(level: str, reset: bool) -> str:
    """The `/logging` query for `--level` / `--reset`. Directives as istioctl takes them
    (`<level>` or `<logger>:<level>`, `::` paths, `warning` and `critical` too) in the proxy's syntax."""
    if reset and level:
        raise ConfigViewError("--level cannot be combined with --reset")
    if reset:
        return "reset"
    directives = []
    for directive in filter(None, (d.strip() for d in level.split(","))):
        head, value = _split_directive(directive)
        spelled = LOG_LEVELS.get(value.lower())
        if spelled is None:
            raise ConfigViewError(f"unrecognized logging level: {value}")
        directives.append(f"{head}={spelled}" if head else spelled)
    return urllib.parse.urlencode({"level": ",".join(directives)}, safe="=,:")


def _split_directive(directive: str) -> tuple[str, str]:
    """(logger, level): the logger is what precedes the last `=` or single `:` (`ztunnel::proxy:debug`)."""
    for i in range(len(directive) - 1, -1, -1):
        c = directive[i]
        in_path = c == ":" and (directive[i - 1 : i] == ":" or directive[i + 1 : i + 2] == ":")
        if c == "=" or (c == ":" and not in_path):
            return directive[:i], directive[i + 1 :]
    return "", directive


# --- the command -------------------------------------------------------------------------------

# (name, aliases, help), as istioctl names them.
VIEWS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("log", ("o",), "retrieve the proxy's logging levels, and update them optionally"),
    ("workload", ("w", "workloads"), "the workloads the proxy knows"),
    ("certificate", ("certificates", "certs", "cert"), "the proxy's workload certificates"),
    ("service", ("services", "s", "svc"), "the services the proxy knows"),
    ("policy", ("policies", "p", "pol"), "the authorization policies the proxy knows"),
    ("all", (), "every summary above, and the connections"),
    ("connections", ("cons",), "each in-pod workload's open connections"),
)
CANONICAL = {alias: name for name, aliases, _ in VIEWS for alias in (name, *aliases)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    views = parser.add_subparsers(dest="view", metavar="{" + ",".join(v[0] for v in VIEWS) + "}")
    views.required = True
    for name, aliases, help_text in VIEWS:
        sub = views.add_parser(name, aliases=list(aliases), help=help_text, description=help_text)
        sub.add_argument(
            "admin",
            nargs="?",
            metavar="ADDRESS",
            help=f"the proxy's admin server, [host][:port] (default {DEFAULT_HOST})",
        )
        sub.add_argument(
            "--admin",
            dest="admin_flag",
            metavar="HOST:PORT",
            help="the proxy's admin server, as ADDRESS (give one or the other)",
        )
        sub.add_argument(
            "--proxy-admin-port",
            type=int,
            default=DEFAULT_ADMIN_PORT,
            help="admin port when ADDRESS has none",
        )
        sub.add_argument("-o", "--output", default="short", help="output format: one of json|yaml|short")
        if name != "log":
            sub.add_argument(
                "-f", "--file", default="", help="a /config_dump JSON file ('-': stdin) instead of a proxy"
            )
        _add_view_flags(name, sub)


def _add_view_flags(name: str, sub: argparse.ArgumentParser) -> None:
    if name == "log":
        sub.add_argument(
            "--level",
            default="",
            help="[<logger>:]<level>,...: trace, debug, info, warning, error, critical, off",
        )
        sub.add_argument(
            "-r", "--reset", action="store_true", help="reset the levels to the proxy's start-up ones"
        )
    elif name == "workload":
        sub.add_argument("--address", default="", help="filter workloads by address field")
        sub.add_argument("--workload-namespace", default="", help="filter workloads by namespace field")
        sub.add_argument("--workload-node", default="", help="filter workloads by node")
    elif name == "service":
        sub.add_argument("--service-namespace", default="", help="filter services by namespace field")
    elif name == "policy":
        sub.add_argument("--policy-namespace", default="", help="filter policies by namespace field")
    elif name == "all":
        sub.add_argument("--with-headers", action="store_true", help="print summary with headers")
    elif name == "connections":
        sub.add_argument(
            "--direction", default="", choices=["", "inbound", "outbound"], help="filter by direction"
        )
        sub.add_argument("--raw", action="store_true", help="show IP addresses instead of names")
        sub.add_argument("--workload-namespace", default="", help="filter workloads by namespace field")


def run(args: argparse.Namespace, out: Callable[[str], object] = sys.stdout.write) -> int:
    view = CANONICAL[args.view]
    try:
        flag = getattr(args, "admin_flag", None)
        if flag is not None:
            if args.admin is not None and args.admin != flag:
                raise ConfigViewError(f"two admin addresses: {args.admin!r} and --admin {flag!r}")
            args.admin = flag
        if not 0 < args.proxy_admin_port < 65536:
            raise ConfigViewError(f"invalid --proxy-admin-port {args.proxy_admin_port}: expected 1-65535")
        if view == "log":
            if args.output != "short":
                raise ConfigViewError("--output is not applicable for this command")
            base = admin_url(args.admin, args.proxy_admin_port)
            reply = _request(f"{base}/logging?{log_query(args.level, args.reset)}", "POST")
            out(f"{base.removeprefix('http://')}:\n{reply}\n")
            return 0
        if args.output not in OUTPUTS:
            raise ConfigViewError(f"output format {args.output!r} not supported")
        if args.file and args.admin:
            raise ConfigViewError("at most one of --file or ADDRESS must be passed")
        dump = read_dump(args.file) if args.file else fetch_dump(admin_url(args.admin, args.proxy_admin_port))
        out(render(view, dump, args))
    except ConfigViewError as e:
        print(f"ztunnel config {args.view}: {e}", file=sys.stderr)
        return 1
    return 0
