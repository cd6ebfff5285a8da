"""In-pod mode's node side: the node agent `ztunnel cni-agent` and the CNI plugin
`ztunnel-cni`.

The plugin is what the container runtime calls for each pod; it forwards the pod's event to the agent.
The agent writes the pod's redirection rules inside the pod's network namespace and hands the namespace
to ztunnel over ZDS. Like the control plane, this package talks to ztunnel only over the wire
and never imports `ztunnel`.

This module stays light (argparse only), so the `ztunnel` CLI can describe the command cheaply.
"""

from __future__ import annotations

import argparse

DEFAULT_ZDS_SOCKET = "/var/run/ztunnel/ztunnel.sock"
DEFAULT_CNI_SOCKET = "/var/run/ztunnel/cni-agent.sock"
DEFAULT_STATE_FILE = "/var/run/ztunnel/cni-agent-pods.json"
DEFAULT_ZTUNNEL_WAIT = 10.0
DEFAULT_EXCLUDE_NAMESPACES = "kube-system,istio-system"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `ztunnel cni-agent`."""
    parser.add_argument(
        "--zds-socket",
        default=DEFAULT_ZDS_SOCKET,
        metavar="PATH",
        help=f"where ztunnel connects, SOCK_SEQPACKET (default {DEFAULT_ZDS_SOCKET})",
    )
    parser.add_argument(
        "--cni-socket",
        default=DEFAULT_CNI_SOCKET,
        metavar="PATH",
        help=f"where the ztunnel-cni plugin reports pod events (default {DEFAULT_CNI_SOCKET})",
    )
    parser.add_argument(
        "--state-file",
        default=DEFAULT_STATE_FILE,
        metavar="PATH",
        help=f"the enrolled pods, kept across agent restarts (default {DEFAULT_STATE_FILE})",
    )
    parser.add_argument(
        "--ztunnel-wait",
        type=float,
        default=DEFAULT_ZTUNNEL_WAIT,
        metavar="SECONDS",
        help=f"how long a pod's ADD waits for a ztunnel to connect before failing (default {DEFAULT_ZTUNNEL_WAIT:g})",
    )
    parser.add_argument(
        "--no-dns-capture",
        action="store_true",
        help="leave pods' DNS alone (by default UDP and TCP to port 53 go to the DNS proxy on 15053)",
    )
    install = parser.add_argument_group(
        "plugin install", "put ztunnel-cni on the node and chain it into the primary network configuration"
    )
    install.add_argument(
        "--cni-bin-dir", metavar="DIR", help="the node's CNI bin directory, e.g. /opt/cni/bin"
    )
    install.add_argument(
        "--cni-conf-dir", metavar="DIR", help="the node's CNI conf directory, e.g. /etc/cni/net.d"
    )
    install.add_argument(
        "--node-cni-socket",
        metavar="PATH",
        help="the CNI socket's path as the node sees it, written into the chained configuration "
        "(default: --cni-socket)",
    )
    install.add_argument(
        "--node-python",
        default="/usr/bin/env python3",
        metavar="PATH",
        help="the interpreter line of the copied plugin: the node's python3, 3.11 or later (default: %(default)s)",
    )
    install.add_argument(
        "--exclude-namespaces",
        default=DEFAULT_EXCLUDE_NAMESPACES,
        metavar="NS,NS",
        help="namespaces whose pods the chained plugin passes through, as istio-cni's exclusions "
        f"(default {DEFAULT_EXCLUDE_NAMESPACES}; ztunnel's own must be among them)",
    )
    install.add_argument(
        "--uninstall",
        action="store_true",
        help="take ztunnel-cni out of the conf directory's configurations, delete it from the bin directory, exit",
    )
