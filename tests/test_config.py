"""Config.from_env: every variable, its default, and the one-line error for each invalid value."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ztunnel.config.settings import (
    Config,
    ConfigError,
    WorkloadInfo,
    illegal_ports,
    parse_duration,
)
from ztunnel.control import plaintext_token_note, token_for


def cfg(**env: str) -> Config:
    return Config.from_env(env, mesh_config_path=None)


def error(**env: str) -> str:
    with pytest.raises(ConfigError) as e:
        cfg(**env)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_defaults_of_an_empty_environment() -> None:
    c = cfg()
    assert c.proxy_mode == "shared"
    assert c.workload_info is None
    assert c.local_xds_path is None and c.local_xds is None
    assert c.xds_address == "https://localhost:15012"
    assert c.ca_address == "https://localhost:15012"
    assert c.xds_root_ca == c.ca_root_ca == "./var/run/secrets/istio/root-cert.pem"
    assert c.fake_ca is False
    assert c.secret_ttl == 86400.0
    assert c.cluster_id == "Kubernetes"
    assert c.trust_domain == "cluster.local"
    assert c.cluster_domain == "cluster.local"
    assert c.network == ""
    assert (
        c.node_name is None and c.pod_name is None and c.pod_namespace is None and c.service_account is None
    )
    assert c.instance_ip == "1.1.1.1"
    assert c.enable_socks5 is False
    assert c.inpod_uds == "/var/run/ztunnel/ztunnel.sock"
    assert c.packet_mark == 1337
    assert c.pool_max_streams_per_connection == 100
    assert c.pool_unused_release_timeout == 300.0
    assert c.metrics_stale_series_grace_period == 300.0
    assert c.http2_stream_window_size == 4 * 1024 * 1024
    assert c.http2_connection_window_size == 16 * 1024 * 1024
    assert c.http2_frame_size == 1024 * 1024
    assert c.connection_termination_deadline == 5.0
    assert c.log_format == "plain"
    assert c.log_level == "info"
    assert c.worker_threads >= 2
    assert c.proxy_bind_address is None
    assert c.socks5_address == ("127.0.0.1", 15080)
    assert c.admin_address == ("127.0.0.1", 15000)
    assert c.stats_address == ("0.0.0.0", 15020)
    assert c.readiness_address == ("0.0.0.0", 15021)
    assert c.localhost_app_tunnel is True
    assert c.enable_response_baggage is True
    assert c.ipv6_enabled is True
    assert (c.keepalive_enabled, c.keepalive_time, c.keepalive_interval, c.keepalive_retries) == (
        True,
        180,
        180,
        9,
    )
    assert c.enable_orig_src is None
    assert dict(c.istio_meta) == {}
    assert c.dns_capture is True
    assert c.dns_proxy_addr == ("127.0.0.1", 15053)


def test_config_is_immutable() -> None:
    c = cfg()
    with pytest.raises(AttributeError):
        c.proxy_mode = "dedicated"  # type: ignore[misc]


def test_dedicated_mode_with_workload_info() -> None:
    c = cfg(PROXY_MODE="dedicated", PROXY_WORKLOAD_INFO="demo/client-1/client-sa")
    assert c.proxy_mode == "dedicated"
    assert c.workload_info == WorkloadInfo(namespace="demo", name="client-1", service_account="client-sa")
    assert c.packet_mark is None


def test_packet_mark_given_in_dedicated_mode() -> None:
    c = cfg(PROXY_MODE="dedicated", PROXY_WORKLOAD_INFO="a/b/c", PACKET_MARK="7")
    assert c.packet_mark == 7


def test_bad_proxy_mode() -> None:
    assert error(PROXY_MODE="sidecar") == "invalid env var PROXY_MODE=sidecar (expected shared or dedicated)"


def test_dedicated_mode_requires_workload_info() -> None:
    assert error(PROXY_MODE="dedicated") == (
        "invalid env var PROXY_WORKLOAD_INFO= (required when PROXY_MODE=dedicated)"
    )


@pytest.mark.parametrize("value", ["demo/client", "demo/client/sa/x", "demo//sa", ""])
def test_bad_workload_info(value: str) -> None:
    assert error(PROXY_WORKLOAD_INFO=value) == (
        f"invalid env var PROXY_WORKLOAD_INFO={value} (expected namespace/name/serviceaccount)"
    )


def test_local_xds_sources() -> None:
    assert cfg(LOCAL_XDS_PATH="/etc/z.yaml").local_xds_path == "/etc/z.yaml"
    assert cfg(LOCAL_XDS="workloads: []").local_xds == "workloads: []"


def test_local_xds_path_and_inline_are_exclusive() -> None:
    assert error(LOCAL_XDS_PATH="/a.yaml", LOCAL_XDS="workloads:\n- uid: x") == (
        "invalid env var LOCAL_XDS=workloads:\\n- uid: x (LOCAL_XDS_PATH and LOCAL_XDS are mutually exclusive)"
    )


def test_xds_address_forms() -> None:
    assert cfg(XDS_ADDRESS="").xds_address is None
    assert cfg(XDS_ADDRESS="istiod:15012").xds_address == "https://istiod:15012"
    assert cfg(XDS_ADDRESS="http://127.0.0.1:15012").xds_address == "http://127.0.0.1:15012"
    assert cfg(XDS_ADDRESS="https://cp:15012").xds_address == "https://cp:15012"
    assert cfg(KUBERNETES_SERVICE_HOST="10.0.0.1").xds_address == "https://istiod.istio-system.svc:15012"
    assert cfg(PROXY_CONFIG="discoveryAddress: cp.example:15012").xds_address == "https://cp.example:15012"
    assert cfg(PROXY_CONFIG="discoveryAddress: x:1", XDS_ADDRESS="y:2").xds_address == "https://y:2"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("ftp://cp:15012", "expected an http:// or https:// address"),
        ("https://cp:notaport", "invalid port"),
        ("https://:15012", "missing host"),
    ],
)
def test_bad_xds_address(value: str, reason: str) -> None:
    assert error(XDS_ADDRESS=value) == f"invalid env var XDS_ADDRESS={value} ({reason})"


def test_ca_address() -> None:
    assert cfg(CA_ADDRESS="http://127.0.0.1:15012").ca_address == "http://127.0.0.1:15012"
    assert cfg(CA_ADDRESS="ca:15012").ca_address == "https://ca:15012"
    assert cfg(CA_ADDRESS="").ca_address is None
    assert cfg(KUBERNETES_SERVICE_HOST="x").ca_address == "https://istiod.istio-system.svc:15012"
    fake = cfg(FAKE_CA="true", CA_ADDRESS="http://ignored:1")
    assert fake.fake_ca is True and fake.ca_address is None
    assert error(CA_ADDRESS="grpc://ca:1") == (
        "invalid env var CA_ADDRESS=grpc://ca:1 (expected an http:// or https:// address)"
    )


def test_root_cas_and_hostnames() -> None:
    c = cfg(XDS_ROOT_CA="SYSTEM", CA_ROOT_CA="/tmp/root.pem", ALT_XDS_HOSTNAME="a", ALT_CA_HOSTNAME="b")
    assert (c.xds_root_ca, c.ca_root_ca, c.alt_xds_hostname, c.alt_ca_hostname) == (
        "SYSTEM",
        "/tmp/root.pem",
        "a",
        "b",
    )


def test_grpc_headers() -> None:
    c = cfg(XDS_HEADER_X_TENANT="a", CA_HEADER_FOO="b")
    assert c.xds_headers == (("x_tenant", "a"),)
    assert c.ca_headers == (("foo", "b"),)
    assert (
        error(XDS_HEADER_BAD="x\x01") == "invalid env var XDS_HEADER_BAD=x\x01 (invalid gRPC metadata value)"
    )
    assert error(**{"CA_HEADER_A B": "x"}) == "invalid env var CA_HEADER_A B=x (invalid gRPC metadata key)"


def test_auth_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert cfg().auth_token is None
    assert cfg(AUTH_TOKEN="static-token").auth_token == "static-token"
    token = tmp_path / "var/run/secrets/tokens/istio-token"
    token.parent.mkdir(parents=True)
    token.write_text("jwt")
    assert cfg().auth_token == "./var/run/secrets/tokens/istio-token"
    assert cfg(AUTH_TOKEN="/other").auth_token == "/other"


def test_a_token_found_goes_over_tls_only_one_set_explicitly_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    token = tmp_path / "var/run/secrets/tokens/istio-token"
    token.parent.mkdir(parents=True)
    token.write_text("jwt")
    found, explicit = cfg(), cfg(AUTH_TOKEN=str(token))
    clear, tls = "http://cp:15010", "https://cp:15012"
    assert token_for(found, tls) == "./var/run/secrets/tokens/istio-token"
    assert token_for(found, clear) is None and token_for(found, "HTTP://cp:15010") is None
    assert token_for(explicit, clear) == token_for(explicit, tls) == str(token)
    assert plaintext_token_note(found, (tls, tls)) is None
    assert plaintext_token_note(found, (clear, None)) == (
        False,
        "the token file ./var/run/secrets/tokens/istio-token is not sent over plaintext to http://cp:15010; "
        "set AUTH_TOKEN to send it anyway",
    )
    assert plaintext_token_note(explicit, (clear, clear)) == (
        True,
        "AUTH_TOKEN is sent over plaintext to http://cp:15010: anyone on the path can read it",
    )
    assert plaintext_token_note(Config(), (clear, clear)) is None  # no token at all


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("500ms", 0.5),
        ("30s", 30),
        ("5m", 300),
        ("24h", 86400),
        ("1h30m", 5400),
        ("90", 90),
        ("1.5s", 1.5),
        ("2d", 172800),
    ],
)
def test_durations(value: str, seconds: float) -> None:
    assert parse_duration(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["", "5x", "m5", "1h 30m", "-5s", "h"])
def test_bad_durations(value: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(value)


def test_duration_variables() -> None:
    c = cfg(
        SECRET_TTL="12h",
        POOL_UNUSED_RELEASE_TIMEOUT="30s",
        KEEPALIVE_TIME="1m",
        KEEPALIVE_INTERVAL="10s",
        CONNECTION_TERMINATION_DEADLINE="500ms",
        METRICS_STALE_SERIES_GRACE_PERIOD="1m30s",
    )
    assert c.metrics_stale_series_grace_period == 90
    assert cfg(METRICS_STALE_SERIES_GRACE_PERIOD="0").metrics_stale_series_grace_period == 0
    assert c.secret_ttl == 43200
    assert c.pool_unused_release_timeout == 30
    assert c.keepalive_time == 60
    assert c.keepalive_interval == 10
    assert c.connection_termination_deadline == 0.5


def test_bad_duration_message() -> None:
    assert error(SECRET_TTL="forever") == (
        "invalid env var SECRET_TTL=forever (expected a duration such as 500ms, 30s, 5m, 24h or 1h30m)"
    )
    assert error(SECRET_TTL="0s") == "invalid env var SECRET_TTL=0s (must be greater than zero)"


@pytest.mark.parametrize(
    ("grace", "deadline"), [("30", 25.0), ("11", 6.0), ("10", 9.0), ("2", 1.0), ("1", 1.0), ("0", 1.0)]
)
def test_termination_deadline_from_grace_period(grace: str, deadline: float) -> None:
    assert cfg(TERMINATION_GRACE_PERIOD_SECONDS=grace).connection_termination_deadline == deadline


def test_termination_deadline_wins_over_grace_period() -> None:
    c = cfg(CONNECTION_TERMINATION_DEADLINE="3s", TERMINATION_GRACE_PERIOD_SECONDS="30")
    assert c.connection_termination_deadline == 3.0
    assert error(TERMINATION_GRACE_PERIOD_SECONDS="soon") == (
        "invalid env var TERMINATION_GRACE_PERIOD_SECONDS=soon (expected an integer)"
    )


BOOLS = [
    ("FAKE_CA", "fake_ca"),
    ("UNSTABLE_ENABLE_SOCKS5", "enable_socks5"),
    ("LOCALHOST_APP_TUNNEL", "localhost_app_tunnel"),
    ("ENABLE_RESPONSE_BAGGAGE", "enable_response_baggage"),
    ("IPV6_ENABLED", "ipv6_enabled"),
    ("KEEPALIVE_ENABLED", "keepalive_enabled"),
    ("ENABLE_ORIG_SRC", "enable_orig_src"),
    ("INPOD_PORT_REUSE", "inpod_port_reuse"),
    ("TLS12_ENABLED", "tls12_enabled"),
    ("USER_TIMEOUT_ENABLED", "user_timeout_enabled"),
    ("AUTHZ_POLICY_INFO_LOGGING", "authz_policy_info_logging"),
]


@pytest.mark.parametrize(("var", "attr"), BOOLS)
def test_bools(var: str, attr: str) -> None:
    assert getattr(cfg(**{var: "true"}), attr) is True
    assert getattr(cfg(**{var: "FALSE"}), attr) is False
    assert error(**{var: "yes"}) == f"invalid env var {var}=yes (expected true or false)"


def test_identity_and_node_variables() -> None:
    c = cfg(
        CLUSTER_ID="c1",
        TRUST_DOMAIN="td.example",
        CLUSTER_DOMAIN="corp.local",
        NETWORK="net1",
        NODE_NAME="node-a",
        POD_NAME="ztunnel-x",
        POD_NAMESPACE="istio-system",
        SERVICE_ACCOUNT="ztunnel",
        INSTANCE_IP="10.0.0.5",
        INPOD_UDS="/tmp/z.sock",
        CRL_PATH="/tmp/crl.pem",
        PREFERED_SERVICE_NAMESPACE="ns1",
    )
    assert (c.cluster_id, c.trust_domain, c.cluster_domain, c.network) == (
        "c1",
        "td.example",
        "corp.local",
        "net1",
    )
    assert (c.node_name, c.pod_name, c.pod_namespace, c.service_account) == (
        "node-a",
        "ztunnel-x",
        "istio-system",
        "ztunnel",
    )
    assert c.instance_ip == "10.0.0.5"
    assert c.inpod_uds == "/tmp/z.sock"
    assert c.crl_path == "/tmp/crl.pem"
    assert c.prefered_service_namespace == "ns1"
    assert error(INSTANCE_IP="10.0.0") == "invalid env var INSTANCE_IP=10.0.0 (expected an IP address)"


def test_istio_meta() -> None:
    c = cfg(
        ISTIO_META_CLUSTER_ID="meta-cluster",
        CLUSTER_ID="env-cluster",
        ISTIO_META_ISTIO_VERSION="1.24.0",
        ISTIO_METAJSON_LABELS='{"app": "x"}',
        PROXY_CONFIG="proxyMetadata: {ISTIO_META_FROM_PC: a, DNS_CAPTURE: 'false'}",
    )
    assert c.cluster_id == "meta-cluster"
    assert c.istio_meta["ISTIO_VERSION"] == "1.24.0"
    assert c.istio_meta["FROM_PC"] == "a"
    assert c.istio_version == "1.24.0"
    assert dict(c.istio_meta_json) == {"LABELS": {"app": "x"}}
    assert c.dns_capture is False
    assert error(ISTIO_METAJSON_X="{") == "invalid env var ISTIO_METAJSON_X={ (expected JSON)"


def test_dns_capture_and_address() -> None:
    assert cfg(ISTIO_META_DNS_CAPTURE="TRUE").dns_capture is True
    assert cfg(ISTIO_META_DNS_CAPTURE="no").dns_capture is False
    assert cfg(ISTIO_META_DNS_PROXY_ADDR="localhost:5353").dns_proxy_addr == ("127.0.0.1", 5353)
    assert cfg(ISTIO_META_DNS_PROXY_ADDR="[::1]:53").dns_proxy_addr == ("::1", 53)
    assert (
        error(ISTIO_META_DNS_PROXY_ADDR="dns")
        == "invalid env var ISTIO_META_DNS_PROXY_ADDR=dns (expected ip:port)"
    )


def test_integers() -> None:
    c = cfg(
        POOL_MAX_STREAMS_PER_CONNECTION="50",
        HTTP2_STREAM_WINDOW_SIZE="65535",
        HTTP2_CONNECTION_WINDOW_SIZE="1048576",
        HTTP2_FRAME_SIZE="16384",
        KEEPALIVE_RETRIES="3",
    )
    assert c.pool_max_streams_per_connection == 50
    assert c.http2_stream_window_size == 65535
    assert c.http2_connection_window_size == 1048576
    assert c.http2_frame_size == 16384
    assert c.keepalive_retries == 3


@pytest.mark.parametrize(
    ("var", "value", "reason"),
    [
        ("POOL_MAX_STREAMS_PER_CONNECTION", "many", "expected an integer"),
        ("POOL_MAX_STREAMS_PER_CONNECTION", "0", "must be at least 1"),
        ("HTTP2_FRAME_SIZE", "1024", "must be at least 16384"),
        ("HTTP2_FRAME_SIZE", "16777216", "must be at most 16777215"),
        ("HTTP2_STREAM_WINDOW_SIZE", "2147483648", "must be at most 2147483647"),
        ("HTTP2_CONNECTION_WINDOW_SIZE", "100", "must be at least 65535"),
        ("PACKET_MARK", "-1", "must be at least 0"),
        ("KEEPALIVE_RETRIES", "x", "expected an integer"),
    ],
)
def test_bad_integers(var: str, value: str, reason: str) -> None:
    assert error(**{var: value}) == f"invalid env var {var}={value} ({reason})"


def test_log_settings() -> None:
    assert cfg(LOG_FORMAT="json").log_format == "json"
    assert cfg(LOG_LEVEL="info,access=debug").log_level == "info,access=debug"
    assert cfg(RUST_LOG="error,ztunnel::proxy=warn").log_level == "error,ztunnel::proxy=warn"
    assert cfg(LOG_LEVEL="debug", RUST_LOG="error").log_level == "debug"
    assert error(LOG_FORMAT="xml") == "invalid env var LOG_FORMAT=xml (expected plain or json)"
    message = error(LOG_LEVEL="info,access=loud")
    assert message.startswith("invalid env var LOG_LEVEL=info,access=loud (invalid level 'loud'")
    assert error(RUST_LOG="chatty").startswith("invalid env var RUST_LOG=chatty (invalid level")


def test_worker_threads() -> None:
    assert cfg(ZTUNNEL_WORKER_THREADS="3").worker_threads == 3
    assert cfg(ZTUNNEL_CPU_LIMIT="8", ZTUNNEL_WORKER_THREADS="0").worker_threads == 8
    assert cfg(ZTUNNEL_CPU_LIMIT="8", ZTUNNEL_WORKER_THREADS="30%").worker_threads == 3
    assert cfg(ZTUNNEL_CPU_LIMIT="1", ZTUNNEL_WORKER_THREADS="10%").worker_threads == 1
    # Default: max(ceil(25 % of CPUs), request, 2).
    assert cfg(ZTUNNEL_CPU_LIMIT="16").worker_threads == 4
    assert cfg(ZTUNNEL_CPU_LIMIT="4").worker_threads == 2
    assert cfg(ZTUNNEL_CPU_LIMIT="16", ZTUNNEL_RESOURCE_CPU_REQUEST="6").worker_threads == 6
    # With a resource limit: max(limit, request), rounded up.
    assert cfg(ZTUNNEL_RESOURCE_CPU_LIMIT="1500m").worker_threads == 2
    assert cfg(ZTUNNEL_RESOURCE_CPU_LIMIT="1").worker_threads == 1
    assert cfg(ZTUNNEL_CPU_LIMIT="8", PROXY_CONFIG="concurrency: 0").worker_threads == 8
    assert cfg(PROXY_CONFIG="concurrency: 5").worker_threads == 5
    expected = len(os.sched_getaffinity(0))
    assert cfg(ZTUNNEL_WORKER_THREADS="0").worker_threads == expected
    # Istio's chart passes 0 when the container has no CPU limit: the CPUs are then the machine's.
    assert cfg(ZTUNNEL_CPU_LIMIT="0", ZTUNNEL_WORKER_THREADS="0").worker_threads == expected


@pytest.mark.parametrize(
    ("var", "value", "reason"),
    [
        ("ZTUNNEL_WORKER_THREADS", "many", "expected an integer, N% (1-100) or 0"),
        ("ZTUNNEL_WORKER_THREADS", "150%", "expected an integer, N% (1-100) or 0"),
        ("ZTUNNEL_RESOURCE_CPU_LIMIT", "2 cores", "expected a CPU quantity such as 2, 1.5 or 500m"),
        ("ZTUNNEL_CPU_LIMIT", "-1", "must be at least 0"),
    ],
)
def test_bad_worker_threads(var: str, value: str, reason: str) -> None:
    assert error(**{var: value}) == f"invalid env var {var}={value} ({reason})"


def test_addresses() -> None:
    c = cfg(
        PROXY_BIND_ADDRESS="127.0.0.2",
        SOCKS5_ADDRESS="127.0.0.2:1080",
        ADMIN_ADDRESS="[::1]:9000",
        STATS_ADDRESS="127.0.0.1:0",
        READINESS_ADDRESS="0.0.0.0:9021",
    )
    assert c.proxy_bind_address == "127.0.0.2"
    assert c.socks5_address == ("127.0.0.2", 1080)
    assert c.admin_address == ("::1", 9000)
    assert c.stats_address == ("127.0.0.1", 0)
    assert c.readiness_address == ("0.0.0.0", 9021)
    assert cfg(PROXY_BIND_ADDRESS="").proxy_bind_address is None


@pytest.mark.parametrize(
    ("var", "value", "reason"),
    [
        ("ADMIN_ADDRESS", "localhost:15000", "expected ip:port"),
        ("STATS_ADDRESS", "127.0.0.1", "expected ip:port"),
        ("READINESS_ADDRESS", "::1:15021", "expected ip:port"),
        ("SOCKS5_ADDRESS", "127.0.0.1:70000", "expected ip:port with a port in 0-65535"),
        ("PROXY_BIND_ADDRESS", "pod-ip", "expected an IP address"),
    ],
)
def test_bad_addresses(var: str, value: str, reason: str) -> None:
    assert error(**{var: value}) == f"invalid env var {var}={value} ({reason})"


def test_proxy_config_ports() -> None:
    c = cfg(PROXY_CONFIG='{"proxyAdminPort": 9000, "statsPort": 9020}')
    assert c.admin_address == ("127.0.0.1", 9000)
    assert c.stats_address == ("0.0.0.0", 9020)
    assert cfg(PROXY_CONFIG="proxyAdminPort: 9000", ADMIN_ADDRESS="127.0.0.1:1").admin_address == (
        "127.0.0.1",
        1,
    )


def test_bad_proxy_config() -> None:
    assert error(PROXY_CONFIG="[1, 2]") == "invalid env var PROXY_CONFIG=[1, 2] (expected a mapping)"
    assert (
        error(PROXY_CONFIG="statsPort: x")
        == "invalid env var PROXY_CONFIG=statsPort: x (statsPort: expected a port number)"
    )
    assert error(PROXY_CONFIG="a: [").startswith("invalid env var PROXY_CONFIG=a: [ (")


def test_mesh_config_file(tmp_path: Path) -> None:
    mesh = tmp_path / "mesh"
    mesh.write_text("defaultConfig:\n  discoveryAddress: mesh-cp:15012\n  proxyMetadata: {A: '1', B: '1'}\n")
    c = Config.from_env({"PROXY_CONFIG": "proxyMetadata: {B: '2'}"}, mesh_config_path=str(mesh))
    assert c.xds_address == "https://mesh-cp:15012"
    assert dict(c.istio_meta) == {"A": "1", "B": "2"}
    assert (
        Config.from_env({}, mesh_config_path=str(tmp_path / "missing")).xds_address
        == "https://localhost:15012"
    )
    mesh.write_text("defaultConfig: [")
    with pytest.raises(ConfigError, match=f"^failed parsing mesh config file {mesh}: "):
        Config.from_env({}, mesh_config_path=str(mesh))


def test_cross_checks() -> None:
    assert error(XDS_ON_DEMAND="true") == (
        "invalid configuration: the DNS proxy does not support XDS_ON_DEMAND=true"
    )
    assert cfg(XDS_ON_DEMAND="true", ISTIO_META_DNS_CAPTURE="false").xds_on_demand is True
    assert error(ENABLE_PROXY="false", ISTIO_META_DNS_CAPTURE="false") == (
        "invalid configuration: ztunnel run without any servers enabled"
    )


def test_illegal_ports() -> None:
    assert illegal_ports(cfg()) == {15001, 15006, 15008}
    assert illegal_ports(cfg(UNSTABLE_ENABLE_SOCKS5="true")) == {15001, 15006, 15008, 15080}


def test_to_dump_is_camel_case_and_hides_secrets() -> None:
    c = cfg(
        PROXY_MODE="dedicated",
        PROXY_WORKLOAD_INFO="demo/c/sa",
        AUTH_TOKEN="secret-token",
        LOCAL_XDS="workloads: []",
        XDS_HEADER_X_TENANT="tenant-secret",
        ADMIN_ADDRESS="[::1]:15000",
    )
    dump = c.to_dump()
    assert dump["proxyMode"] == "dedicated"
    assert dump["workloadInfo"] == {"namespace": "demo", "name": "c", "serviceAccount": "sa"}
    assert dump["adminAddress"] == "[::1]:15000"
    assert dump["secretTtl"] == 86400.0
    assert dump["xdsHeaders"] == ["x_tenant"]
    assert dump["authToken"] == "<redacted>"
    assert "localXds" not in dump
    text = repr(dump)
    assert "secret-token" not in text and "tenant-secret" not in text
    assert all("_" not in key for key in dump)
