"""The in-pod redirection: what the agent writes into an enrolled pod's network namespace.

In the nat table, the pod's own outbound TCP goes to ztunnel's 15001 and inbound TCP to 15006, except:

* packets from (and to) 169.254.7.127, the kubelet probe address, left unmodified;
* packets carrying mark 0x539/0xfff: ztunnel's own sockets in the pod set SO_MARK 1337;
* loopback traffic (out `lo`, or to 127.0.0.0/8; inbound to 127.0.0.1);
* inbound HBONE to 15008, which ztunnel's listener in the pod receives directly.

The pod's DNS (UDP and TCP to port 53, leaving by any interface but `lo`) goes to the DNS proxy on
15053, unless the agent runs without DNS capture; ztunnel's own forwarded queries carry the mark and
pass. IPv4 only: the proxy listens on 127.0.0.1. For inbound connections that ztunnel makes to the
app with the client's address as source, the app's replies must come back to ztunnel rather than
leave the pod: the mangle table gives such connections (first seen looping back with mark 0x539)
connmark 0x111, restores it as the mark of the app's replies, and a policy rule sends marked packets
to table 100, whose one route is `local default dev lo`.

Our rules live in chains of our own, ZTUNNEL-PREROUTING and ZTUNNEL-OUTPUT of the nat and mangle
tables, each reached by one jump from the built-in chain of the same name: installing twice leaves one
copy, and removal leaves the pod's tables as it found them.

The rule text comes from pure functions over what `iptables-save` printed, testable without root;
`install`, `check` and `remove` run `iptables-save`/`iptables-restore` and `ip` inside the pod's
namespace with `nsenter --net=<path>`. IPv4 is required; IPv6 (ip6tables) is best-effort, as a pod may
have IPv6 disabled.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from dataclasses import dataclass

log = logging.getLogger("cni.redirect")

PREROUTING_CHAIN = "ZTUNNEL-PREROUTING"
OUTPUT_CHAIN = "ZTUNNEL-OUTPUT"
OUTBOUND_PORT = 15001
INBOUND_PLAINTEXT_PORT = 15006
DNS_PORT = 53
DNS_PROXY_PORT = 15053
HBONE_PORT = 15008
PROBE_ADDRESS = "169.254.7.127"
MARK = "0x539/0xfff"  # ztunnel's SO_MARK 1337, low 12 bits
REPLY_MARK = "0x111/0xfff"  # connections to the app that ztunnel made, whose replies stay in the pod
REPLY_TABLE = 100
REPLY_RULE_PREF = 32764
TABLES = ("mangle", "nat")

_JUMPS = (("PREROUTING", PREROUTING_CHAIN), ("OUTPUT", OUTPUT_CHAIN))
_TIMEOUT = 10.0


class RedirectError(Exception):
    """The rules could not be read or written in a pod's namespace."""


@dataclass(frozen=True)
class Family:
    name: str
    option: str  # of `ip`
    save: str  # the iptables-save of this family
    restore: str
    loopback: str  # the loopback destination an inbound rule leaves alone
    loopback_net: str
    any: str  # the default destination, for the reply route
    probe_source: str | None  # the kubelet probe address, when the family has one


IPV4 = Family(
    "IPv4",
    "-4",
    "iptables-save",
    "iptables-restore",
    "127.0.0.1/32",
    "127.0.0.0/8",
    "0.0.0.0/0",
    f"{PROBE_ADDRESS}/32",
)
IPV6 = Family("IPv6", "-6", "ip6tables-save", "ip6tables-restore", "::1/128", "::1/128", "::/0", None)


# -- pure: the rule text ---------------------------------------------------------------------------


def chain_rules(family: Family = IPV4, dns: bool = True) -> dict[str, list[str]]:
    """Per table, the rules of our chains, spelled as `iptables-save` prints them (`check` compares)."""
    pre, out = PREROUTING_CHAIN, OUTPUT_CHAIN
    mangle = [
        f"-A {pre} -m mark --mark {MARK} -j CONNMARK --set-xmark {REPLY_MARK}",
        f"-A {out} -m connmark --mark {REPLY_MARK} -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff",
    ]
    nat = []
    if family.probe_source:
        nat.append(f"-A {pre} -s {family.probe_source} -j ACCEPT")
    nat += [
        f"-A {pre} -m mark --mark {MARK} -j ACCEPT",
        f"-A {pre} ! -d {family.loopback} -p tcp -m tcp ! --dport {HBONE_PORT} -j REDIRECT --to-ports {INBOUND_PLAINTEXT_PORT}",
    ]
    if family.probe_source:
        nat.append(f"-A {out} -d {family.probe_source} -j ACCEPT")
    nat += [
        f"-A {out} -m mark --mark {MARK} -j ACCEPT",
    ]
    if dns and family is IPV4:
        nat += [
            f"-A {out} ! -o lo -p {proto} -m {proto} --dport {DNS_PORT} -j REDIRECT --to-ports {DNS_PROXY_PORT}"
            for proto in ("udp", "tcp")
        ]
    nat += [
        f"-A {out} -o lo -j ACCEPT",
        f"-A {out} -d {family.loopback_net} -j ACCEPT",
        f"-A {out} -p tcp -j REDIRECT --to-ports {OUTBOUND_PORT}",
    ]
    return {"mangle": mangle, "nat": nat}


def _table(saved: str, table: str) -> list[str]:
    """The lines of one table's section in `iptables-save` output."""
    lines: list[str] = []
    inside = False
    for raw in saved.splitlines():
        line = raw.strip()
        if line.startswith("*"):
            inside = line == f"*{table}"
        elif line == "COMMIT":
            inside = False
        elif inside:
            lines.append(line)
    return lines


def table_rules(saved: str, table: str) -> list[str]:
    """The `-A` lines of `table` in `iptables-save` output (empty when the table is absent)."""
    return [line for line in _table(saved, table) if line.startswith("-A ")]


def _declared(saved: str, table: str) -> set[str]:
    return {line[1:].split()[0] for line in _table(saved, table) if line.startswith(":")}


def _jump(builtin: str, chain: str) -> str:
    return f"-A {builtin} -j {chain}"


def install_script(saved: str, family: Family = IPV4, dns: bool = True) -> str:
    """`iptables-restore --noflush` input that leaves exactly our rules in place, whatever `saved` holds.

    Declaring our chains flushes them; the jumps are added (first in their built-in chain) only when
    missing, and extra copies are dropped."""
    lines = []
    for table, rules in chain_rules(family, dns).items():
        present = table_rules(saved, table)
        lines += [f"*{table}", f":{PREROUTING_CHAIN} - [0:0]", f":{OUTPUT_CHAIN} - [0:0]"]
        for builtin, chain in _JUMPS:
            copies = present.count(_jump(builtin, chain))
            lines += [f"-D {builtin} -j {chain}"] * max(copies - 1, 0)
            if copies == 0:
                lines.append(f"-I {builtin} 1 -j {chain}")
        lines += [*rules, "COMMIT"]
    return "\n".join(lines) + "\n"


def remove_script(saved: str) -> str | None:
    """`iptables-restore --noflush` input deleting the jumps and our chains; None when nothing is there."""
    lines = []
    for table in TABLES:
        present, declared = table_rules(saved, table), _declared(saved, table)
        body = []
        for builtin, chain in _JUMPS:
            body += [f"-D {builtin} -j {chain}"] * present.count(_jump(builtin, chain))
        for _, chain in _JUMPS:
            if chain in declared:
                body += [f"-F {chain}", f"-X {chain}"]
        if body:
            lines += [f"*{table}", *body, "COMMIT"]
    return "\n".join(lines) + "\n" if lines else None


def missing_rules(saved: str, family: Family = IPV4, dns: bool = True) -> list[str]:
    """What of our rules `saved` lacks, as `-t <table> <rule>`: empty when they are all in place.

    Each of our chains must hold exactly our rules, in order (iptables-save prints chains sorted)."""
    missing = []
    for table, rules in chain_rules(family, dns).items():
        present = table_rules(saved, table)
        missing += [f"-t {table} {_jump(b, c)}" for b, c in _JUMPS if _jump(b, c) not in present]
        for _, chain in _JUMPS:
            prefix = f"-A {chain} "
            have = [r for r in present if r.startswith(prefix)]
            want = [r for r in rules if r.startswith(prefix)]
            if have != want:
                absent = [f"-t {table} {r}" for r in want if r not in have]
                missing += absent or [f"-t {table} {chain}: rules out of order or extra rules"]
    return missing


def has_reply_routing(shown: str) -> tuple[bool, bool]:
    """In `ip rule show` and `ip route show table 100` output: (the fwmark rule, the local route)."""
    rule = any(f"fwmark {REPLY_MARK} lookup {REPLY_TABLE}" in line for line in shown.splitlines())
    route = any(line.split()[:4] == ["local", "default", "dev", "lo"] for line in shown.splitlines())
    return rule, route


def reply_routing_batch(rule_present: bool, family: Family = IPV4) -> str:
    """`ip -batch -` input giving marked replies the local route (idempotent given `rule_present`)."""
    lines = (
        [] if rule_present else [f"rule add fwmark {REPLY_MARK} pref {REPLY_RULE_PREF} lookup {REPLY_TABLE}"]
    )
    lines.append(f"route replace local {family.any} dev lo table {REPLY_TABLE}")
    return "\n".join(lines) + "\n"


def reply_routing_removal(family: Family = IPV4) -> str:
    """`ip -force -batch -` input undoing `reply_routing_batch` (errors for what is absent are fine)."""
    return (
        f"rule del fwmark {REPLY_MARK} pref {REPLY_RULE_PREF} lookup {REPLY_TABLE}\n"
        f"route del local {family.any} dev lo table {REPLY_TABLE}\n"
    )


_SHOW_ROUTING = f"rule show\nroute show table {REPLY_TABLE}\n"


# -- in a pod's namespace --------------------------------------------------------------------------


def _run(netns: str, args: list[str], stdin: str | None = None, check: bool = True) -> str:
    try:
        done = subprocess.run(
            ["nsenter", f"--net={netns}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RedirectError(f"{args[0]} in {netns}: {e}") from None
    if check and done.returncode != 0:
        detail = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise RedirectError(f"{args[0]} in {netns}: {detail[-1] if detail else f'exit {done.returncode}'}")
    return done.stdout


def _families() -> list[Family]:
    return [IPV4] + ([IPV6] if shutil.which(IPV6.restore) else [])


def install(netns: str, dns: bool = True) -> None:
    """Write the rules into the namespace at `netns` (idempotent); `dns`: capture the pod's DNS too.
    IPv4 failures raise RedirectError."""
    for family in _families():
        try:
            saved = _run(netns, [family.save])
            _run(netns, [family.restore, "--noflush"], install_script(saved, family, dns))
            rule, _ = has_reply_routing(_run(netns, ["ip", family.option, "-batch", "-"], _SHOW_ROUTING))
            _run(netns, ["ip", family.option, "-batch", "-"], reply_routing_batch(rule, family))
        except RedirectError as e:
            if family is IPV4:
                raise
            log.debug("no %s redirection: %s", family.name, e)


def check(netns: str, dns: bool = True) -> list[str]:
    """What of the IPv4 redirection the namespace at `netns` lacks; empty when it is in place."""
    missing = missing_rules(_run(netns, [IPV4.save]), IPV4, dns)
    rule, route = has_reply_routing(_run(netns, ["ip", "-4", "-batch", "-"], _SHOW_ROUTING))
    if not rule:
        missing.append(f"ip rule fwmark {REPLY_MARK} lookup {REPLY_TABLE}")
    if not route:
        missing.append(f"ip route local default dev lo table {REPLY_TABLE}")
    return missing


def remove(netns: str) -> None:
    """Delete our chains, jumps and reply routing from the namespace at `netns`.

    The IPv4 rules raise RedirectError when they cannot be removed."""
    for family in _families():
        try:
            script = remove_script(_run(netns, [family.save]))
            if script is not None:
                _run(netns, [family.restore, "--noflush"], script)
            _run(
                netns,
                ["ip", family.option, "-force", "-batch", "-"],
                reply_routing_removal(family),
                check=False,
            )
        except RedirectError as e:
            if family is IPV4:
                raise
            log.debug("no %s rules removed: %s", family.name, e)
