"""Policies in the local config: string matches (tags and map form), every match key, the nesting
of rules."""

from __future__ import annotations

import pytest

from policy.model import (
    Action,
    Match,
    Scope,
    ServiceAccountMatch,
    StringMatch,
    StringMatchKind,
)
from tests.localdocs import (
    net,
    only_match,
    parse,
)


def test_string_match_tags_and_map_form() -> None:
    tags = only_match("{principals: [!Exact a, !Prefix b, !Suffix c, !Presence []]}")
    maps = only_match("{principals: [{Exact: a}, {Prefix: b}, {Suffix: c}, {Presence: []}]}")
    expected = (
        StringMatch(StringMatchKind.EXACT, "a"),
        StringMatch(StringMatchKind.PREFIX, "b"),
        StringMatch(StringMatchKind.SUFFIX, "c"),
        StringMatch(StringMatchKind.PRESENCE),
    )
    assert tags.principals == expected
    assert maps.principals == expected


# In a flow sequence a bare tag needs a space before `]`: libyaml, like PyYAML, reads `]` as part of a tag.
@pytest.mark.parametrize(
    "presence",
    ["!Presence []", "!Presence ", "!Presence null", "!Presence ''", "{Presence: []}", "{Presence: null}"],
)
def test_presence_forms(presence: str) -> None:
    assert only_match(f"{{notPrincipals: [{presence}]}}").not_principals == (
        StringMatch(StringMatchKind.PRESENCE),
    )


def test_tagged_scalars_stay_text() -> None:
    assert only_match("{namespaces: [!Exact 123, !Exact true]}").namespaces == (
        StringMatch(StringMatchKind.EXACT, "123"),
        StringMatch(StringMatchKind.EXACT, "true"),
    )


def test_every_match_key() -> None:
    m = only_match(
        """{namespaces: [!Exact a], notNamespaces: [!Prefix b], principals: [!Suffix /sa/c],
            notPrincipals: [!Presence []], sourceIps: [10.0.0.1, 10.0.0.0/8], notSourceIps: ["fd00::1"],
            destinationIps: [192.168.1.7/24], notDestinationIps: ["::/0"], destinationPorts: [80],
            notDestinationPorts: [0, 65535], serviceAccounts: [{namespace: a, serviceAccount: b}],
            notServiceAccounts: [{namespace: c, serviceAccount: d}]}"""
    )
    assert m == Match(
        namespaces=(StringMatch(StringMatchKind.EXACT, "a"),),
        not_namespaces=(StringMatch(StringMatchKind.PREFIX, "b"),),
        principals=(StringMatch(StringMatchKind.SUFFIX, "/sa/c"),),
        not_principals=(StringMatch(StringMatchKind.PRESENCE),),
        source_ips=(net("10.0.0.1/32"), net("10.0.0.0/8")),
        not_source_ips=(net("fd00::1/128"),),
        destination_ips=(net("192.168.1.0/24"),),
        not_destination_ips=(net("::/0"),),
        destination_ports=(80,),
        not_destination_ports=(0, 65535),
        service_accounts=(ServiceAccountMatch("a", "b"),),
        not_service_accounts=(ServiceAccountMatch("c", "d"),),
    )


def test_rules_nesting_and_flags() -> None:
    cfg = parse(
        """
        policies:
          - name: p
            namespace: ns
            scope: WorkloadSelector
            action: Deny
            dryRun: true
            rules:
              - - - {destinationPorts: [1]}
                  - {destinationPorts: [2]}
                - - {destinationPorts: [3]}
              - []
        """
    )
    (p,) = cfg.policies
    assert (p.scope, p.action, p.dry_run, p.key) == (Scope.WORKLOAD_SELECTOR, Action.DENY, True, "ns/p")
    assert p.rules == (
        (
            (Match(destination_ports=(1,)), Match(destination_ports=(2,))),
            (Match(destination_ports=(3,)),),
        ),
        (),
    )
