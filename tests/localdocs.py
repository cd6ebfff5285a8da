"""The reference's example local config, and how the local-config tests read a document."""

from __future__ import annotations

import ipaddress
import textwrap

import pytest

from mesh.localconfig import (
    LocalConfig,
    LocalConfigError,
    parse_local_config,
)
from policy.model import (
    Match,
)

SPEC_EXAMPLE = """\
workloads:
  - uid: lab//v1/Pod/demo/client
    name: client
    namespace: demo
    serviceAccount: client-sa
    trustDomain: cluster.local
    workloadIps: ["127.0.0.1"]
    protocol: HBONE
    node: node-a
  - uid: lab//v1/Pod/demo/server
    name: server
    namespace: demo
    serviceAccount: server-sa
    trustDomain: cluster.local
    workloadIps: ["127.0.0.2"]
    protocol: HBONE
    node: node-a
    services:
      "demo/server.demo.svc.cluster.local":
        80: 8080
services:
  - name: server
    namespace: demo
    hostname: server.demo.svc.cluster.local
    vips: ["/10.96.1.1"]
    ports:
      80: 8080
policies:
  - name: only-client
    namespace: demo
    scope: Namespace
    action: Allow
    dryRun: false
    rules:
      - - - principals: [!Exact "cluster.local/ns/demo/sa/client-sa"]
  - name: block-9999
    namespace: demo
    scope: Namespace
    action: Deny
    dryRun: false
    rules:
      - - - destinationPorts: [9999]
"""


def ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


def net(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network(text)


def parse(text: str) -> LocalConfig:
    return parse_local_config(textwrap.dedent(text), "config.yaml")


def error_of(text: str) -> str:
    with pytest.raises(LocalConfigError) as info:
        parse(text)
    return str(info.value)


def only_match(text: str) -> Match:
    """The single match entry of a policy whose match is `text` (YAML flow mapping)."""
    cfg = parse(
        f"""
        policies:
          - {{name: p, namespace: ns, scope: Global, action: Allow, dryRun: false, rules: [[[{text}]]]}}
        """
    )
    return cfg.policies[0].rules[0][0][0]
