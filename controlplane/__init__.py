"""The development control plane: Delta ADS and a CA over gRPC, fed from a YAML file or Kubernetes
manifests (`kube`, istiod's ambient index).

It talks to proxies only over the wire and never imports `ztunnel`, which is what makes it a fair test
of wire compatibility. `ads` serves the resources, `snapshot` names and versions them, `source`
loads and watches the file (and `kube` the manifests), `ca` signs certificates, `server` runs them on one port.

This module stays light (argparse only), so the `ztunnel` CLI can describe the command without
importing gRPC.
"""

from __future__ import annotations

import argparse

DEFAULT_LISTEN = "127.0.0.1:15012"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `ztunnel control-plane`."""
    parser.add_argument("--config", metavar="FILE", help="local-config YAML to serve (watched)")
    parser.add_argument(
        "--kube",
        metavar="PATH",
        help="Kubernetes manifests (a file or a directory) to serve as istiod would (watched);"
        " with --config, both are served",
    )
    parser.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"gRPC address (default {DEFAULT_LISTEN})",
    )
    parser.add_argument("--tls", action="store_true", help="serve TLS with a certificate signed by the CA")
    parser.add_argument(
        "--ca-dir", metavar="DIR", help="where the CA root is kept (default: under $XDG_STATE_HOME)"
    )
    parser.add_argument(
        "--auth-token",
        metavar="FILE",
        help="require every call to carry `authorization: Bearer <the token in FILE>`, as istiod does",
    )
    parser.add_argument(
        "--cluster-id",
        metavar="ID",
        help="require every call to carry the `clusterid: ID` header; the cluster --kube workloads are named in"
        " (default Kubernetes)",
    )
    parser.add_argument(
        "--max-recv-msg-size",
        metavar="BYTES",
        help="the largest gRPC message taken from a proxy (default: $ISTIO_GPRC_MAXRECVMSGSIZE, else 4194304,"
        " as istiod); a larger one ends its stream with RESOURCE_EXHAUSTED",
    )
