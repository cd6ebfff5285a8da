"""`GET /debug/explain?src=IP&dst=IP:PORT`: what would happen now to a connection from `src` to `dst`.

An answer built from the same pure functions the listeners call, on the same state: `route()` for the
client side (the service, the endpoint candidates and the one picked, the waypoint, the protocol)
and `admit()` for the destination's proxy (each policy considered, the rule that matched, the
decision and its reason string, exactly as a denied connection's access log would carry it). The
endpoint is picked at random per connection, as the data path does, so `picked` is one draw among
`candidates`.

The source is the workload with address `src` in this proxy's network; the destination's proxy is
assumed to run with this proxy's settings (its network, its own ports).
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any

from hbone.address import format_addr
from hbone.identity import Identity
from mesh.model import IPAddress, Service, Workload
from policy import Authorization, Connection
from policy.model import Action
from policy.rbac import rule_matches
from ztunnel.admin.server import GET, HttpEndpoint, Request, Response
from ztunnel.config.settings import HBONE_PORT, Config, illegal_ports
from ztunnel.decisions.admission import AdmissionRules, Admit, InboundRequest, admit, parse_authority
from ztunnel.decisions.route import NoRoute, Protocol, Route, apply_preferences, endpoint_candidates, route
from ztunnel.state.store import ProxyState


class ExplainError(ValueError):
    """A question that cannot be answered (bad parameters, unknown source); its text says why."""


def parse_query(src: str | None, dst: str | None) -> tuple[IPAddress, tuple[IPAddress, int]]:
    if not src or not dst:
        raise ExplainError("usage: /debug/explain?src=IP&dst=IP:PORT")
    try:
        src_ip = ipaddress.ip_address(src)
    except ValueError:
        raise ExplainError(f"invalid src={src}: expected an IP address") from None
    target = parse_authority(dst)
    if target is None or isinstance(target[0], str):
        raise ExplainError(f"invalid dst={dst}: expected IP:PORT ([IPv6]:PORT)")
    return src_ip, (target[0], target[1])


def explain(
    state: ProxyState, config: Config, src_ip: IPAddress, dst: tuple[IPAddress, int]
) -> dict[str, Any]:
    """The route and the authorization a connection from `src_ip` to `dst` would get now."""
    network = config.network
    source = state.workload_by_addr(network, src_ip)
    if source is None:
        raise ExplainError(f"no workload has address {network}/{src_ip}: the source must be a mesh workload")
    answer: dict[str, Any] = {
        "source": _workload(source),
        "destination": format_addr(*dst),
        "route": None,
        "authorization": None,
    }
    r = route(state, source, dst, network=network, source_ip=src_ip)
    answer["route"] = _route(state, source, dst, r, network)
    if isinstance(r, Route):
        answer["authorization"] = _authorization(state, config, source, src_ip, r)
    return answer


def _workload(w: Workload) -> dict[str, Any]:
    return {"uid": w.uid, "name": w.name, "namespace": w.namespace, "identity": w.identity_uri}


def _route(
    state: ProxyState, source: Workload, dst: tuple[IPAddress, int], r: Route | NoRoute, network: str
) -> dict[str, Any]:
    ip, port = dst
    workload = state.workload_by_addr(network, ip)
    service = None if workload is not None else state.service_for_vip(network, ip, source.namespace)
    if workload is not None:
        why = "the address of a workload (addressed directly)"
    elif service is not None:
        why = f"a VIP of service {service.key}"
    else:
        why = "an address the mesh does not know: passed through as dialled"
    out: dict[str, Any] = {"addressed": why}
    if service is not None:
        candidates = apply_preferences(service, source, endpoint_candidates(state, source, service, port))
        out["service"] = _service(service)
        out["loadBalancing"] = (
            service.load_balancer.mode.name if service.load_balancer is not None else "STANDARD"
        )
        out["candidates"] = [
            {"workload": w.uid, "targetPort": target, "weight": max(w.capacity, 0)}
            for w, target in candidates
        ]
    if isinstance(r, NoRoute):
        out["result"] = "no route"
        out["reason"] = r.reason
        return out
    out["result"] = "route"
    out["protocol"] = r.protocol.value
    out["nextHop"] = format_addr(r.next_hop[0], r.next_hop[1])
    out["authority"] = r.authority
    out["waypoint"] = r.waypoint
    out["picked"] = r.workload.uid if r.workload is not None else None
    out["expectedIdentities"] = list(r.expected_identities)
    if r.protocol is Protocol.DOUBLE_HBONE:
        out["innerAuthority"] = r.inner_authority
        out["finalIdentities"] = list(r.final_identities)
    return out


def _service(s: Service) -> dict[str, Any]:
    return {"key": s.key, "hostname": s.hostname, "ports": {str(p): t for p, t in s.ports}}


def _authorization(
    state: ProxyState, config: Config, source: Workload, src_ip: IPAddress, r: Route
) -> dict[str, Any]:
    target = r.workload
    if target is None:
        return {"evaluatedAt": None, "note": "no mesh workload at the destination: nothing authorizes"}
    if r.waypoint:
        return {
            "evaluatedAt": target.uid,
            "note": "the connection ends at the destination's waypoint, which applies its own policy; "
            "the destination's proxy then sees the waypoint's identity",
        }
    if r.protocol is Protocol.DOUBLE_HBONE:
        return {"evaluatedAt": target.uid, "note": "in another network: decided by that network's proxy"}
    if r.needs_dns:
        return {"evaluatedAt": target.uid, "note": "the workload's address comes from DNS when connecting"}
    hbone = r.protocol is Protocol.HBONE
    if hbone:
        assert r.authority is not None
        host = parse_authority(r.authority)
        assert host is not None and not isinstance(host[0], str)
        local = (host[0], HBONE_PORT)
        request = InboundRequest(
            peer=(src_ip, 0),
            local=local,
            method="CONNECT",
            authority=r.authority,
            identity=Identity.try_parse(source.identity_uri),
            headers={},
        )
    else:
        next_ip = r.next_hop[0]
        assert not isinstance(next_ip, str)
        request = InboundRequest(peer=(src_ip, 0), local=(next_ip, r.next_hop[1]))
    rules = AdmissionRules(network=config.network, illegal_ports=illegal_ports(config))
    decision = admit(state, target, request, rules)
    out: dict[str, Any] = {
        "evaluatedAt": target.uid,
        "identity": source.identity_uri if hbone else None,
        "decision": "allow" if isinstance(decision, Admit) else "deny",
    }
    if not isinstance(decision, Admit):
        out["status"] = decision.status
        out["reason"] = decision.reason
    if decision.plan is not None:
        out["policies"] = [_policy(p, decision.plan.connection) for p in state.policies_for(target)]
    if decision.notes:
        out["notes"] = list(decision.notes)
    return out


def _policy(p: Authorization, conn: Connection) -> dict[str, Any]:
    matched = next((i for i, rule in enumerate(p.compiled) if rule_matches(rule, conn)), None)
    return {
        "policy": p.key,
        "action": "ALLOW" if p.action is Action.ALLOW else "DENY",
        "dryRun": p.dry_run,
        "matched": matched is not None,
        "matchedRule": matched,
    }


def explain_route(state: ProxyState, config: Config) -> HttpEndpoint:
    """The admin endpoint: 200 and the answer, or 400 and `{"error": ...}`."""

    def handle(request: Request) -> Response:
        try:
            src, dst = parse_query(_last(request, "src"), _last(request, "dst"))
            body: dict[str, Any] = explain(state, config, src, dst)
            status = 200
        except ExplainError as e:
            body, status = {"error": str(e)}, 400
        return Response(status, json.dumps(body, indent=2).encode() + b"\n", "application/json")

    return HttpEndpoint(
        handle, GET, "?src=IP&dst=IP:PORT: the route and authorization such a connection gets now"
    )


def _last(request: Request, name: str) -> str | None:
    values = request.query.get(name)
    return values[-1] if values else None
