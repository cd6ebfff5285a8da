"""Authorization evaluation: every case of the reference's `rbac.rs` tests (1-42) plus
edge cases of the evaluation order and the match semantics."""

from __future__ import annotations

import ipaddress

import pytest

from hbone.identity import Identity
from policy import (
    Action,
    Allow,
    Authorization,
    Connection,
    Deny,
    Match,
    Scope,
    ServiceAccountMatch,
    StringMatch,
    StringMatchKind,
    authorize,
)
from policy.model import Rule
from policy.rbac import is_empty, matches, string_matches


def conn(
    identity: str | None = None,
    src: str = "127.0.0.1:1234",
    dst: str = "127.0.0.2:8080",
    dst_network: str = "",
) -> Connection:
    src_ip, src_port = src.rsplit(":", 1)
    dst_ip, dst_port = dst.rsplit(":", 1)
    parsed = Identity.try_parse(identity) if identity else None
    return Connection(
        src_ip=ipaddress.ip_address(src_ip.strip("[]")),
        src_port=int(src_port),
        dst_ip=ipaddress.ip_address(dst_ip.strip("[]")),
        dst_port=int(dst_port),
        src_principal=identity,
        src_namespace=parsed.namespace if parsed else None,
        src_service_account=parsed.service_account if parsed else None,
        dst_network=dst_network,
    )


def from_namespace(ns: str, dst_port: int = 8080, dst_network: str = "") -> Connection:
    return conn(f"spiffe://td/ns/{ns}/sa/account", dst=f"127.0.0.2:{dst_port}", dst_network=dst_network)


P = conn()
T = conn("spiffe://td/ns/namespace/sa/account")
A = conn("spiffe://td-alt/ns/ns-alt/sa/sa=alt", src="127.0.0.3:1234", dst="127.0.0.4:9090")


def exact(value: str) -> StringMatch:
    return StringMatch(StringMatchKind.EXACT, value)


def net(cidr: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network(cidr, strict=False)


def policy(
    *rules: Rule, action: Action = Action.ALLOW, dry_run: bool = False, name: str = "p"
) -> Authorization:
    return Authorization(
        name=name, namespace="ns1", scope=Scope.NAMESPACE, action=action, rules=rules, dry_run=dry_run
    )


def single(
    entry: Match, action: Action = Action.ALLOW, dry_run: bool = False, name: str = "p"
) -> Authorization:
    """One rule, one clause, one entry."""
    return policy(((entry,),), action=action, dry_run=dry_run, name=name)


# (case, entry, matches P, matches T, matches A)
SINGLE_FIELD = [
    (1, Match(namespaces=(exact("namespace"),)), False, True, False),
    (2, Match(not_namespaces=(exact("namespace"),)), True, False, True),
    (3, Match(service_accounts=(ServiceAccountMatch("namespace", "account"),)), False, True, False),
    (4, Match(not_service_accounts=(ServiceAccountMatch("namespace", "account"),)), True, False, True),
    (5, Match(principals=(exact("td/ns/namespace/sa/account"),)), False, True, False),
    (6, Match(not_principals=(exact("td/ns/namespace/sa/account"),)), True, False, True),
    (7, Match(source_ips=(net("127.0.0.1/32"),)), True, True, False),
    (8, Match(not_source_ips=(net("127.0.0.1/32"),)), False, False, True),
    (9, Match(destination_ips=(net("127.0.0.2/32"),)), True, True, False),
    (10, Match(not_destination_ips=(net("127.0.0.2/32"),)), False, False, True),
    (11, Match(destination_ips=(net("127.0.0.1/24"),)), True, True, True),
    (12, Match(destination_ports=(8080,)), True, True, False),
    (13, Match(not_destination_ports=(8080,)), False, False, True),
]


@pytest.mark.parametrize(
    ("case", "entry", "on_p", "on_t", "on_a"), SINGLE_FIELD, ids=[f"case{c[0]}" for c in SINGLE_FIELD]
)
def test_single_field_policies(case: int, entry: Match, on_p: bool, on_t: bool, on_a: bool) -> None:
    pol = single(entry)
    assert (matches(pol, P), matches(pol, T), matches(pol, A)) == (on_p, on_t, on_a)


@pytest.mark.parametrize(
    ("case", "rules", "expected"),
    [
        (14, (((Match(),),),), False),  # an entry with every field empty is skipped
        (15, (((),),), True),  # a clause with zero entries matches
        (16, ((),), True),  # a rule with zero clauses matches
        (17, (), False),  # zero rules never match
    ],
    ids=["case14", "case15", "case16", "case17"],
)
def test_structure(case: int, rules: tuple[Rule, ...], expected: bool) -> None:
    assert matches(policy(*rules), P) is expected


NESTED = policy(
    (
        (Match(namespaces=(exact("a"),)), Match(namespaces=(exact("b"),))),
        (Match(destination_ports=(80,)),),
    )
)


@pytest.mark.parametrize(
    ("case", "connection", "expected"),
    [
        (18, from_namespace("a", 80), True),
        (19, from_namespace("b", 80), True),
        (20, from_namespace("b", 80, dst_network="remote"), True),
        (21, from_namespace("bad", 80), False),
        (22, from_namespace("b", 12345), False),
    ],
    ids=["case18", "case19", "case20", "case21", "case22"],
)
def test_nesting(case: int, connection: Connection, expected: bool) -> None:
    assert matches(NESTED, connection) is expected


MULTI_RULE = policy(((Match(namespaces=(exact("a"),)),),), ((Match(namespaces=(exact("b"),)),),))


@pytest.mark.parametrize(
    ("case", "namespace", "expected"),
    [(23, "a", True), (24, "b", True), (25, "bad", False)],
    ids=["case23", "case24", "case25"],
)
def test_multi_rule(case: int, namespace: str, expected: bool) -> None:
    assert matches(MULTI_RULE, from_namespace(namespace)) is expected


@pytest.mark.parametrize(
    ("case", "kind", "pattern", "value", "expected"),
    [
        (26, StringMatchKind.EXACT, "foo", "foo", True),
        (27, StringMatchKind.EXACT, "foo", "not", False),
        (28, StringMatchKind.EXACT, "foo", "", False),
        (29, StringMatchKind.PREFIX, "foo", "foobar", True),
        (30, StringMatchKind.PREFIX, "foo", "notfoo", False),
        (31, StringMatchKind.PREFIX, "foo", "", False),
        (32, StringMatchKind.SUFFIX, "foo", "barfoo", True),
        (33, StringMatchKind.SUFFIX, "foo", "foonot", False),
        (34, StringMatchKind.SUFFIX, "foo", "", False),
        (35, StringMatchKind.PRESENCE, "", "foo", True),
        (36, StringMatchKind.PRESENCE, "", "", False),
    ],
    ids=[f"case{n}" for n in range(26, 37)],
)
def test_string_match(case: int, kind: StringMatchKind, pattern: str, value: str, expected: bool) -> None:
    assert string_matches(StringMatch(kind, pattern), value) is expected


def test_string_match_is_case_sensitive() -> None:
    assert not string_matches(exact("Foo"), "foo")
    assert not string_matches(StringMatch(StringMatchKind.PREFIX, "F"), "foo")


# End-to-end decisions (`state.rs::assert_rbac_logic_deny_allow`): all policies are NAMESPACE in ns1,
# so a destination in ns2 has no candidates and one in ns1 has all four.


def principal(sa: str) -> StringMatch:
    return exact(f"cluster.local/ns/default/sa/{sa}")


def source(sa: str) -> Connection:
    return conn(f"spiffe://cluster.local/ns/default/sa/{sa}")


MATCH_ALL: Rule = ((),)
ALLOW_FOO = single(Match(principals=(principal("defaultacct"),)), name="foo")
DENY = single(Match(principals=(principal("denyacct"),)), action=Action.DENY, name="deny")
DRY_RUN_ALLOW = policy(MATCH_ALL, dry_run=True, name="dry-run-allow")
DRY_RUN_DENY = policy(MATCH_ALL, action=Action.DENY, dry_run=True, name="dry-run-deny")
NS1_POLICIES = [ALLOW_FOO, DENY, DRY_RUN_ALLOW, DRY_RUN_DENY]


def candidates(destination_namespace: str) -> list[Authorization]:
    return [p for p in NS1_POLICIES if p.namespace == destination_namespace]


def test_case37_destination_without_policies_allows() -> None:
    assert isinstance(authorize(candidates("ns2"), source("not-defaultacct")), Allow)


def test_case38_allow_policy_match_allows_despite_dry_run_deny() -> None:
    decision = authorize(candidates("ns1"), source("defaultacct"))
    assert isinstance(decision, Allow)
    assert decision.notes == (
        "dry-run: deny policy match policy=ns1/dry-run-deny",
        "dry-run: allow policy match policy=ns1/dry-run-allow",
    )


def test_case39_no_allow_match_denies() -> None:
    decision = authorize(candidates("ns1"), source("not-defaultacct"))
    assert isinstance(decision, Deny)
    assert decision.reason == "allow policies exist, but none allowed"
    assert decision.policy is None


def test_case40_explicit_deny() -> None:
    decision = authorize(candidates("ns1"), source("denyacct"))
    assert isinstance(decision, Deny)
    assert decision.reason == "explicitly denied by: ns1/deny"
    assert decision.policy == "ns1/deny"


@pytest.mark.parametrize("identity", [None, "spiffe://cluster.local/ns/default/sa/denyacct"])
def test_case41_no_policies_at_all_allows(identity: str | None) -> None:
    assert authorize([], conn(identity)) == Allow()


def test_case42_dry_run_policies_log_but_do_not_decide() -> None:
    policies = [
        single(Match(principals=(principal("denyacct"),)), action=Action.DENY, name="deny"),
        single(
            Match(principals=(principal("defaultacct"), principal("denyacct"))),
            action=Action.DENY,
            dry_run=True,
            name="dry-run-deny",
        ),
        single(Match(principals=(principal("defaultacct"),)), name="allow"),
        single(Match(principals=(principal("defaultacct"),)), dry_run=True, name="dry-run-allow"),
    ]
    decision = authorize(policies, source("defaultacct"))
    assert decision == Allow(
        notes=(
            "dry-run: deny policy match policy=ns1/dry-run-deny",
            "dry-run: allow policy match policy=ns1/dry-run-allow",
        )
    )


# Edge cases beyond the reference's table.


def test_strict_mtls_policy_denies_plaintext_only() -> None:
    strict = single(Match(not_principals=(StringMatch(StringMatchKind.PRESENCE),)), action=Action.DENY)
    assert authorize([strict], P) == Deny("explicitly denied by: ns1/p", "ns1/p")
    assert authorize([strict], T) == Allow()


def test_without_identity_no_principal_pattern_matches_not_even_presence() -> None:
    presence = single(Match(principals=(StringMatch(StringMatchKind.PRESENCE),)))
    assert not matches(presence, P)
    assert matches(presence, T)


def test_principal_without_spiffe_prefix_matches_nothing() -> None:
    odd = Connection(
        src_ip=P.src_ip,
        src_port=1,
        dst_ip=P.dst_ip,
        dst_port=8080,
        src_principal="td/ns/namespace/sa/account",
    )
    assert not matches(single(Match(principals=(StringMatch(StringMatchKind.PRESENCE),))), odd)


def test_principal_suffix_pattern() -> None:
    assert matches(single(Match(principals=(StringMatch(StringMatchKind.SUFFIX, "/sa/account"),))), T)


def test_namespace_of_plaintext_is_empty_string() -> None:
    assert matches(single(Match(namespaces=(exact(""),))), P)
    assert not matches(single(Match(namespaces=(StringMatch(StringMatchKind.PRESENCE),))), P)
    assert matches(single(Match(not_namespaces=(exact("X"),))), P)


def test_ipv6_cidr() -> None:
    v6 = conn(src="[fd00::5]:1234", dst="[fd00:1::7]:80")
    assert matches(single(Match(source_ips=(net("fd00::/64"),))), v6)
    assert not matches(single(Match(source_ips=(net("fd01::/64"),))), v6)
    assert matches(single(Match(destination_ips=(net("fd00:1::7/128"),))), v6)


def test_other_family_is_outside_every_network() -> None:
    v6 = conn(src="[fd00::5]:1234", dst="[fd00:1::7]:80")
    assert not matches(single(Match(source_ips=(net("0.0.0.0/0"),))), v6)
    assert not matches(single(Match(source_ips=(net("::/0"),))), P)
    assert matches(single(Match(not_source_ips=(net("0.0.0.0/0"),))), v6)


def test_zero_prefix_matches_everything_of_its_family() -> None:
    assert matches(single(Match(destination_ips=(net("0.0.0.0/0"),))), A)
    assert not matches(single(Match(not_destination_ips=(net("0.0.0.0/0"),))), A)


def test_all_pairs_of_an_entry_must_pass() -> None:
    entry = Match(namespaces=(exact("namespace"),), not_destination_ports=(8080,))
    assert not matches(single(entry), T)  # namespace passes, port fails
    assert matches(single(Match(namespaces=(exact("namespace"),), not_destination_ports=(9090,))), T)


def test_positive_and_negative_of_one_field() -> None:
    entry = Match(
        source_ips=(net("127.0.0.0/8"),), not_source_ips=(net("127.0.0.3/32"),)
    )  # loopback except .3
    assert matches(single(entry), T)
    assert not matches(single(entry), A)


def test_not_list_fails_when_any_element_matches() -> None:
    entry = Match(not_destination_ports=(1, 8080))
    assert not matches(single(entry), T)


def test_service_account_needs_both_parts() -> None:
    assert not matches(single(Match(service_accounts=(ServiceAccountMatch("namespace", "other"),))), T)
    assert not matches(single(Match(service_accounts=(ServiceAccountMatch("other", "account"),))), T)


def test_empty_entry_beside_a_failing_entry_does_not_rescue_the_clause() -> None:
    pol = policy(((Match(), Match(destination_ports=(1,))),))
    assert not matches(pol, P)
    pol = policy(((Match(), Match(destination_ports=(8080,))),))
    assert matches(pol, P)


def test_is_empty() -> None:
    assert is_empty(Match())
    assert not is_empty(Match(not_destination_ports=(0,)))


def test_any_matching_enforced_allow_suffices() -> None:
    no = single(Match(destination_ports=(1,)), name="no")
    yes = single(Match(destination_ports=(8080,)), name="yes")
    assert authorize([no, yes], P) == Allow()
    assert authorize([no], P) == Deny("allow policies exist, but none allowed")


def test_deny_wins_over_allow() -> None:
    allow_all = policy(MATCH_ALL, name="all")
    deny_port = single(Match(destination_ports=(8080,)), action=Action.DENY, name="port")
    assert authorize([allow_all, deny_port], P) == Deny("explicitly denied by: ns1/port", "ns1/port")


def test_deny_with_zero_rules_never_denies() -> None:
    assert authorize([policy(action=Action.DENY)], P) == Allow()


def test_only_dry_run_allows_none_matching_allows_and_notes_it() -> None:
    dry = single(Match(destination_ports=(1,)), dry_run=True, name="dry")
    assert authorize([dry], P) == Allow(notes=("dry-run: no allow policies match",))


def test_only_dry_run_allow_matching_is_noted() -> None:
    dry = policy(MATCH_ALL, dry_run=True, name="dry")
    assert authorize([dry], P) == Allow(notes=("dry-run: allow policy match policy=ns1/dry",))


def test_dry_run_deny_alone_allows() -> None:
    dry = policy(MATCH_ALL, action=Action.DENY, dry_run=True, name="dry")
    assert authorize([dry], P) == Allow(notes=("dry-run: deny policy match policy=ns1/dry",))


def test_no_allow_match_note_not_added_when_enforced_allows_exist() -> None:
    dry = single(Match(destination_ports=(1,)), dry_run=True, name="dry")
    enforced = single(Match(destination_ports=(1,)), name="enforced")
    assert authorize([dry, enforced], P) == Deny("allow policies exist, but none allowed")


def test_explicit_deny_keeps_dry_run_deny_notes() -> None:
    dry = policy(MATCH_ALL, action=Action.DENY, dry_run=True, name="dry")
    enforced = policy(MATCH_ALL, action=Action.DENY, name="enforced")
    assert authorize([dry, enforced], P) == Deny(
        "explicitly denied by: ns1/enforced", "ns1/enforced", ("dry-run: deny policy match policy=ns1/dry",)
    )


def test_duplicate_candidates_are_harmless() -> None:
    assert authorize([ALLOW_FOO, ALLOW_FOO], source("defaultacct")) == Allow()
