"""The proxy's view of the mesh: workloads, services, their endpoints, and policies.

`ProxyState` is fed by the xDS client and the local config file and read by routing, the listeners and
the admin server. It composes one store per kind (`WorkloadStore`, `ServiceStore`, `PolicyStore`:
each value and its indexes) and holds the rules of the lookups over them. It is mutated only on the event loop's thread, so it takes no locks; listeners are
called synchronously once a change (or a `batch()` of changes) is complete.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

from mesh.localconfig import (
    LocalConfig,
)
from mesh.model import (
    Endpoint,
    GatewayAddress,
    HealthPolicy,
    IPAddress,
    NamespacedHostname,
    NetworkAddress,
    NetworkMode,
    Service,
    TunnelProtocol,
    Visibility,
    Workload,
    WorkloadStatus,
)
from mesh.render import (
    endpoint_to_dict,
    policy_to_dict,
    service_to_dict,
    workload_to_dict,
)
from policy.model import Authorization, Scope
from ztunnel.state.image import Tables, Touched, encode_image
from ztunnel.state.names import NameIndex

log = logging.getLogger("ztunnel.state")

Listener = Callable[[], None]
# On-demand xDS: ask the control plane for `key` (`network/ip`, a uid, `namespace/hostname`) and
# return once it answered (True) or gave up waiting (False); `arrived` says whether the store now
# holds what was missing.
Demander = Callable[[str, Callable[[], bool]], Awaitable[bool]]


class ChangeObserver(Protocol):
    """Told of each change as the store makes it (the value before and after; None: absent), of the
    store replaced, and of each committed batch after the listeners: the parent's replication to its
    workers (`ztunnel.workers.replication.Replication`)."""

    def workload_changed(self, before: Workload | None, after: Workload | None) -> None: ...
    def service_changed(self, before: Service | None, after: Service | None) -> None: ...
    def policy_changed(self, key: str, after: Authorization | None) -> None: ...
    def replaced(self) -> None: ...
    def committed(self) -> None: ...


class WorkloadStore:
    """The workloads, by uid in first-seen order, with their indexes: by address, by hostname, by pod
    name, and the service memberships they declare (by service key then uid; those of a service not
    known yet are staged: they count once it arrives)."""

    def __init__(self) -> None:
        self.by_uid: dict[str, Workload] = {}
        self.by_addr: dict[NetworkAddress, list[str]] = {}
        self.by_hostname: dict[NamespacedHostname, list[str]] = {}
        self.by_name = NameIndex()  # the DNS proxy's per-pod names
        self.memberships: dict[str, dict[str, Endpoint]] = {}

    def __len__(self) -> int:
        return len(self.by_uid)

    def upsert(self, w: Workload) -> None:
        previous = self.by_uid.get(w.uid)
        if previous is not None:
            self._unindex(previous)
        self.by_uid[w.uid] = w
        # A host-network workload shares the node's IP, which must not resolve to it.
        if w.network_mode is not NetworkMode.HOST_NETWORK:
            for ip in w.addresses:
                uids = self.by_addr.setdefault(NetworkAddress(w.network, ip), [])
                if w.uid not in uids:
                    uids.append(w.uid)
        if w.hostname:
            uids = self.by_hostname.setdefault(NamespacedHostname(w.namespace, w.hostname), [])
            if w.uid not in uids:
                uids.append(w.uid)
        if w.name:
            self.by_name.add(w.name, w.uid)
        for service_key, ports in w.services:
            self.memberships.setdefault(service_key, {})[w.uid] = Endpoint(w.uid, ports, w.status)

    def remove(self, uid: str) -> bool:
        workload = self.by_uid.pop(uid, None)
        if workload is None:
            return False
        self._unindex(workload)
        return True

    def _unindex(self, w: Workload) -> None:
        for ip in w.addresses:
            _unlist(self.by_addr, NetworkAddress(w.network, ip), w.uid)
        if w.hostname:
            _unlist(self.by_hostname, NamespacedHostname(w.namespace, w.hostname), w.uid)
        if w.name:
            self.by_name.remove(w.name, w.uid)
        for service_key, _ in w.services:
            endpoints = self.memberships.get(service_key)
            if endpoints is not None:
                endpoints.pop(w.uid, None)
                if not endpoints:
                    del self.memberships[service_key]

    def clear(self) -> None:
        self.by_uid.clear()
        self.by_addr.clear()
        self.by_hostname.clear()
        self.by_name.clear()
        self.memberships.clear()

    def at(self, network: str, ip: IPAddress) -> list[Workload]:
        return [self.by_uid[uid] for uid in self.by_addr.get(NetworkAddress(network, ip), ())]


class ServiceStore:
    """The services, by `namespace/hostname` key in first-seen order, with their indexes: by VIP, by
    hostname, and those with CIDR VIPs."""

    def __init__(self) -> None:
        self.by_key: dict[str, Service] = {}
        self.by_vip: dict[NetworkAddress, list[str]] = {}
        self.by_hostname: dict[str, list[str]] = {}
        self.with_cidr_vips: dict[str, Service] = {}

    def __len__(self) -> int:
        return len(self.by_key)

    def upsert(self, s: Service) -> None:
        key = s.key
        previous = self.by_key.get(key)
        if previous is not None:
            for vip in set(previous.vips) - set(s.vips):
                _unlist(self.by_vip, vip, key)
        self.by_key[key] = s
        # An updated service keeps its place among those sharing a VIP or hostname.
        for vip in s.vips:
            keys = self.by_vip.setdefault(vip, [])
            if key not in keys:
                keys.append(key)
        keys = self.by_hostname.setdefault(s.hostname, [])
        if key not in keys:
            keys.append(key)
        if s.cidr_vips:
            self.with_cidr_vips[key] = s
        else:
            self.with_cidr_vips.pop(key, None)

    def remove(self, key: str) -> bool:
        service = self.by_key.pop(key, None)
        if service is None:
            return False
        for vip in service.vips:
            _unlist(self.by_vip, vip, key)
        _unlist(self.by_hostname, service.hostname, key)
        self.with_cidr_vips.pop(key, None)
        return True

    def clear(self) -> None:
        self.by_key.clear()
        self.by_vip.clear()
        self.by_hostname.clear()
        self.with_cidr_vips.clear()

    def at(self, network: str, ip: IPAddress) -> list[Service]:
        return [self.by_key[key] for key in self.by_vip.get(NetworkAddress(network, ip), ())]

    def named(self, hostname: str) -> list[Service]:
        return [self.by_key[key] for key in self.by_hostname.get(hostname, ())]


class PolicyStore:
    """The authorization policies, by key, with the global ones and each namespace's, in order."""

    def __init__(self) -> None:
        self.by_key: dict[str, Authorization] = {}
        self.by_namespace: dict[str, dict[str, None]] = {}  # namespace -> ordered set of keys
        self.global_keys: dict[str, None] = {}

    def upsert(self, p: Authorization) -> None:
        # The same key may come back with another scope or namespace.
        self._unindex(p.key)
        self.by_key[p.key] = p
        if p.scope is Scope.GLOBAL:
            self.global_keys[p.key] = None
        elif p.scope is Scope.NAMESPACE:
            self.by_namespace.setdefault(p.namespace, {})[p.key] = None

    def remove(self, key: str) -> bool:
        if key not in self.by_key:
            return False
        self._unindex(key)
        del self.by_key[key]
        return True

    def _unindex(self, key: str) -> None:
        previous = self.by_key.get(key)
        if previous is None:
            return
        self.global_keys.pop(key, None)
        keys = self.by_namespace.get(previous.namespace)
        if keys is not None:
            keys.pop(key, None)
            if not keys:
                del self.by_namespace[previous.namespace]

    def clear(self) -> None:
        self.by_key.clear()
        self.by_namespace.clear()
        self.global_keys.clear()

    def candidate_keys(self, w: Workload) -> dict[str, None]:
        """The keys of the policies that may apply to `w`, in order: its namespace's, the global
        ones, then those it names."""
        keys = dict.fromkeys(self.by_namespace.get(w.namespace, ()))
        keys.update(dict.fromkeys(self.global_keys))
        keys.update(dict.fromkeys(w.authorization_policies))
        return keys


class MeshTables(Protocol):
    """The workloads and services as the lookups read them, whoever holds them: the parent's stores
    (`MeshStore`) or a worker's view of the parent's images (`ztunnel.state.shared.ImageView`)."""

    def workloads(self) -> list[Workload]: ...
    def services(self) -> list[Service]: ...
    def workload_by_uid(self, uid: str) -> Workload | None: ...
    def workloads_at(self, network: str, ip: IPAddress) -> list[Workload]: ...
    def workload_by_hostname(self, namespace: str, hostname: str) -> Workload | None: ...
    def workloads_by_name(self, name: str) -> list[Workload]: ...
    def local_candidates(self, name: str, namespace: str) -> Iterable[Workload]: ...
    def series_names_present(self, keys: set[tuple[str, str]]) -> set[tuple[str, str]]: ...
    def services_at(self, network: str, ip: IPAddress) -> list[Service]: ...
    def service_by_key(self, key: str) -> Service | None: ...
    def services_named(self, hostname: str) -> list[Service]: ...
    def cidr_services(self) -> Iterable[Service]: ...
    def memberships(self, service_key: str) -> Iterable[Endpoint]: ...


class MeshStore:
    """The parent's workloads and services (its `WorkloadStore` and `ServiceStore`) read as
    `MeshTables`."""

    def __init__(self, workloads: WorkloadStore, services: ServiceStore) -> None:
        self.w = workloads
        self.s = services

    def workloads(self) -> list[Workload]:
        return list(self.w.by_uid.values())

    def services(self) -> list[Service]:
        return list(self.s.by_key.values())

    def workload_by_uid(self, uid: str) -> Workload | None:
        return self.w.by_uid.get(uid)

    def workloads_at(self, network: str, ip: IPAddress) -> list[Workload]:
        return self.w.at(network, ip)

    def workload_by_hostname(self, namespace: str, hostname: str) -> Workload | None:
        uids = self.w.by_hostname.get(NamespacedHostname(namespace, hostname))
        return self.w.by_uid[uids[0]] if uids else None

    def workloads_by_name(self, name: str) -> list[Workload]:
        return [self.w.by_uid[uid] for uid in self.w.by_name.uids(name)]

    def local_candidates(self, name: str, namespace: str) -> Iterable[Workload]:
        return self.w.by_uid.values()

    def series_names_present(self, keys: set[tuple[str, str]]) -> set[tuple[str, str]]:
        return keys & {(w.namespace, w.workload_name or w.name) for w in self.w.by_uid.values()}

    def services_at(self, network: str, ip: IPAddress) -> list[Service]:
        return self.s.at(network, ip)

    def service_by_key(self, key: str) -> Service | None:
        return self.s.by_key.get(key)

    def services_named(self, hostname: str) -> list[Service]:
        return self.s.named(hostname)

    def cidr_services(self) -> Iterable[Service]:
        return self.s.with_cidr_vips.values()

    def memberships(self, service_key: str) -> Iterable[Endpoint]:
        return self.w.memberships.get(service_key, {}).values()


class ProxyState:
    """The store: one store per kind (`WorkloadStore`, `ServiceStore`, `PolicyStore`) composed, the
    rules of the lookups over its tables, and the listeners told of each committed change.

    `tables`: where the lookups read the workloads and services; by default its own stores (the
    parent's), in a worker the parent's images (`ztunnel.state.shared.ImageView`; changed through
    `tables_changed`)."""

    def __init__(self, demander: Demander | None = None, tables: MeshTables | None = None) -> None:
        self.workload_store = WorkloadStore()
        self.service_store = ServiceStore()
        self.policy_store = PolicyStore()
        self.tables: MeshTables = (
            tables if tables is not None else MeshStore(self.workload_store, self.service_store)
        )
        self._warned_unknown: set[tuple[str, str]] = set()  # (workload uid, policy key) warned about
        self._listeners: list[Listener] = []
        self._policy_listeners: list[Listener] = []
        self._batch_depth = 0
        # Answers of the per-connection lookups, forgotten whenever the store changes (every change
        # is made in a `batch`).
        self._by_addr: dict[tuple[str, IPAddress], Workload | None] = {}
        self._policies_of: dict[str, tuple[Workload, list[Authorization]]] = {}
        self._changed = False
        self._policies_changed = False
        self._batch = Batch(self)
        self.demander = demander  # with XDS_ON_DEMAND=true: asks the control plane for a key
        self._observer: ChangeObserver | None = None

    def observe(self, observer: ChangeObserver) -> None:
        """Tell `observer` of every change from now on (one at most: the parent's replication)."""
        assert self._observer is None
        self._observer = observer

    # --- on demand ---------------------------------------------------------------------------------

    async def fetch_address(self, network: str, ip: IPAddress) -> None:
        """With on-demand xDS, make sure the store has what `network/ip` names (a workload, or a
        service by VIP) before a caller looks it up: ask the control plane when it does not."""
        if self.demander is None:
            return

        def known() -> bool:
            return self.workload_by_addr(network, ip) is not None or bool(self.services_by_vip(network, ip))

        if not known():
            await self._demand(f"{network}/{ip}", known)

    async def fetch_destination(self, network: str, ip: IPAddress, client_namespace: str | None) -> None:
        """`fetch_address`, then the waypoints and network gateways what it found names (routing
        needs them too), each asked for once."""
        if self.demander is None:
            return
        await self.fetch_address(network, ip)
        workload = self.workload_by_addr(network, ip)
        gateways: list[GatewayAddress] = []
        if workload is not None:
            gateways += [g for g in (workload.waypoint, workload.network_gateway) if g is not None]
        else:
            service = self.service_for_vip(network, ip, client_namespace)
            if service is not None:
                gateways += [service.waypoint] if service.waypoint is not None else []
                gateways += [w.destination for w in service.weighted_waypoints]
        for gateway in dict.fromkeys(gateways):
            dest = gateway.destination
            if isinstance(dest, NetworkAddress):
                await self.fetch_address(dest.network, dest.address)
            else:
                await self.fetch_hostname(dest.namespace, dest.hostname)

    async def fetch_hostname(self, namespace: str, hostname: str) -> None:
        """As `fetch_address`, for a service or workload named `namespace/hostname`."""
        if self.demander is None:
            return

        def known() -> bool:
            return (
                self.service_by_key(f"{namespace}/{hostname}") is not None
                or self.workload_by_hostname(namespace, hostname) is not None
            )

        if not known():
            await self._demand(f"{namespace}/{hostname}", known)

    async def _demand(self, key: str, known: Callable[[], bool]) -> None:
        assert self.demander is not None
        log.debug("sending demand request", extra={"fields": {"key": key}})
        answered = await self.demander(key, known)
        if answered:
            log.debug("on demand ready", extra={"fields": {"key": key, "found": known()}})
        else:
            log.warning("on-demand request timed out", extra={"fields": {"key": key}})

    # --- listeners ---------------------------------------------------------------------------------

    def subscribe(self, callback: Listener) -> Callable[[], None]:
        """Call `callback` after any change; returns the function that unsubscribes it."""
        self._listeners.append(callback)
        return lambda: self._listeners.remove(callback)

    def subscribe_policies(self, callback: Listener) -> Callable[[], None]:
        """Call `callback` after policies changed (live re-evaluation); workload changes
        alone do not call it."""
        self._policy_listeners.append(callback)
        return lambda: self._policy_listeners.remove(callback)

    def batch(self) -> Batch:
        """Apply several changes, e.g. one xDS response, with one notification at the end."""
        return self._batch

    def _committed(self) -> None:
        """The outermost batch ended: tell the listeners, then the observer."""
        self._notify()
        if self._observer is not None:
            self._observer.committed()

    def tables_changed(self) -> None:
        """The tables changed under the store (a worker's new image): one change, as any other."""
        with self.batch():
            self._changed = True

    def _forget_lookups(self) -> None:
        # Called twice per change (a first push makes some 200,000): clearing only what holds answers.
        if self._by_addr:
            self._by_addr.clear()
        if self._policies_of:
            self._policies_of.clear()

    def _notify(self) -> None:
        changed, policies_changed = self._changed, self._policies_changed
        self._changed = self._policies_changed = False
        listeners = (self._policy_listeners if policies_changed else []) + (
            self._listeners if changed else []
        )
        for callback in list(listeners):
            try:
                callback()
            except Exception:
                log.exception("state listener failed")

    # --- workloads ---------------------------------------------------------------------------------

    def upsert_workload(self, w: Workload) -> None:
        with self.batch():
            store = self.workload_store
            if self._observer is not None:
                self._observer.workload_changed(store.by_uid.get(w.uid), w)
            store.upsert(w)
            self._changed = True

    def remove(self, name: str) -> bool:
        """Remove by xDS resource name: a workload uid, else a `namespace/hostname` service."""
        workload = self.workload_store.by_uid.get(name)
        if workload is not None:
            with self.batch():
                if self._observer is not None:
                    self._observer.workload_changed(workload, None)
                self.workload_store.remove(name)
                self._changed = True
            return True
        _, slash, hostname = name.partition("/")
        if not slash or "/" in hostname:
            return False
        return self.remove_service(name)

    # --- services ----------------------------------------------------------------------------------

    def upsert_service(self, s: Service) -> None:
        with self.batch():
            store = self.service_store
            if self._observer is not None:
                self._observer.service_changed(store.by_key.get(s.key), s)
            store.upsert(s)
            self._changed = True

    def remove_service(self, key: str) -> bool:
        """Remove a service; its workloads' memberships stay, staged until it comes back."""
        service = self.service_store.by_key.get(key)
        if service is None:
            return False
        with self.batch():
            if self._observer is not None:
                self._observer.service_changed(service, None)
            self.service_store.remove(key)
            self._changed = True
        return True

    # --- policies ----------------------------------------------------------------------------------

    def upsert_policy(self, p: Authorization) -> None:
        with self.batch():
            if self._observer is not None:
                self._observer.policy_changed(p.key, p)
            self.policy_store.upsert(p)
            self._changed = self._policies_changed = True

    def remove_policy(self, key: str) -> bool:
        if key not in self.policy_store.by_key:
            return False
        with self.batch():
            if self._observer is not None:
                self._observer.policy_changed(key, None)
            self.policy_store.remove(key)
            self._changed = self._policies_changed = True
        return True

    # --- the local config file ---------------------------------------------------------------------

    def apply_local_config(self, cfg: LocalConfig) -> None:
        """Replace every workload and service and drop every policy, then insert the file's."""
        with self.batch():
            if self._observer is not None:
                self._observer.replaced()  # then the file's values, one by one
            self.workload_store.clear()
            self.service_store.clear()
            self.policy_store.clear()
            self._changed = self._policies_changed = True
            for w in cfg.workloads:
                self.upsert_workload(w)
            for s in cfg.services:
                self.upsert_service(s)
            for p in cfg.policies:
                self.upsert_policy(p)

    # --- lookups -----------------------------------------------------------------------------------

    def workloads(self) -> list[Workload]:
        return self.tables.workloads()

    def services(self) -> list[Service]:
        return self.tables.services()

    def policies(self) -> list[Authorization]:
        return list(self.policy_store.by_key.values())

    def workload_by_uid(self, uid: str) -> Workload | None:
        return self.tables.workload_by_uid(uid)

    def workload_by_addr(self, network: str, ip: IPAddress) -> Workload | None:
        """When workloads share an address, a pod wins, then an HBONE one, then the first seen."""
        key = (network, ip)
        try:
            return self._by_addr[key]
        except KeyError:
            pass
        candidates = self.tables.workloads_at(network, ip)
        found = (
            max(candidates, key=lambda w: ("//Pod/" in w.uid, w.tunnel_protocol is TunnelProtocol.HBONE))
            if candidates
            else None
        )
        if len(self._by_addr) >= _LOOKUPS_KEPT:
            self._by_addr.clear()
        self._by_addr[key] = found
        return found

    def workload_by_hostname(self, namespace: str, hostname: str) -> Workload | None:
        """A workload named by `namespace/hostname` (a waypoint or gateway given by hostname)."""
        return self.tables.workload_by_hostname(namespace, hostname)

    def workloads_by_name(self, name: str) -> list[Workload]:
        """Every workload of this name (a pod's name, in any namespace or cluster), in the order
        they were last updated: the DNS proxy's per-pod names of headless services."""
        return self.tables.workloads_by_name(name)

    def series_names_present(self, keys: set[tuple[str, str]]) -> set[tuple[str, str]]:
        """Which of `keys` (namespace, workload name as metric series name it: `workload_name`, else
        the name) some workload of the store has."""
        return self.tables.series_names_present(keys)

    def services_by_vip(self, network: str, ip: IPAddress) -> list[Service]:
        """Every service with this exact VIP, whatever its visibility, in first-seen order."""
        return self.tables.services_at(network, ip)

    def service_for_vip(self, network: str, ip: IPAddress, client_namespace: str | None) -> Service | None:
        """The service a client addressing `ip` reaches: by exact VIP, else by the best CIDR VIP."""
        exact = _preferred(self.services_by_vip(network, ip), client_namespace)
        if exact is not None:
            return exact
        best: Service | None = None
        best_rank: tuple[bool, int, bool] | None = None
        for service in self.tables.cidr_services():
            if not visible_to(service, client_namespace):
                continue
            for vip in service.cidr_vips:
                if vip.network != network or ip not in vip.cidr:
                    continue
                rank = (service.namespace == client_namespace, vip.cidr.prefixlen, service.canonical)
                if best_rank is None or rank > best_rank:
                    best, best_rank = service, rank
        return best

    def service_by_hostname(
        self,
        hostname: str,
        client_namespace: str | None,
        preferred_namespace: str | None = None,
        candidate: Callable[[Service], bool] | None = None,
    ) -> Service | None:
        """`preferred_namespace` is the DNS proxy's PREFERED_SERVICE_NAMESPACE tie-break; `candidate`,
        when given, decides which of the services with that hostname take part."""
        services = self.tables.services_named(hostname)
        if candidate is not None:
            services = [s for s in services if candidate(s)]
        return _preferred(services, client_namespace, preferred_namespace)

    def service_by_key(self, key: str) -> Service | None:
        return self.tables.service_by_key(key)

    def endpoints(self, service_key: str) -> list[Endpoint]:
        """The endpoints in use: the service's own and its workloads', unhealthy ones only under
        ALLOW_ALL. Empty for an unknown service (its endpoints are staged)."""
        service = self.service_by_key(service_key)
        if service is None:
            return []
        memberships: Iterable[Endpoint] = self.tables.memberships(service_key)
        if service.endpoints:
            merged = {ep.workload_uid: ep for ep in service.endpoints}
            merged.update((ep.workload_uid, ep) for ep in memberships)
            memberships = merged.values()
        lb = service.load_balancer
        if lb is not None and lb.health_policy is HealthPolicy.ALLOW_ALL:
            return list(memberships)
        return [ep for ep in memberships if ep.status is WorkloadStatus.HEALTHY]

    def find_local_workload(
        self, name: str, namespace: str, service_account: str, node_name: str | None
    ) -> Workload | None:
        """The proxy's own workload, looked for among the workloads of its node (all when no node).
        When several match (a pod and a WorkloadEntry of one name), the smallest uid: every process
        of the proxy, whatever order it holds them in, finds the same."""
        found = [
            w
            for w in self.tables.local_candidates(name, namespace)
            if (not node_name or w.node == node_name)
            and w.name == name
            and w.namespace == namespace
            and w.service_account == service_account
        ]
        return min(found, key=lambda w: w.uid) if found else None

    def policy(self, key: str) -> Authorization | None:
        return self.policy_store.by_key.get(key)

    def policies_for(self, w: Workload) -> list[Authorization]:
        """The candidate policies of a destination workload (a list kept until the store changes:
        not to be changed by the caller)."""
        hit = self._policies_of.get(w.uid)
        if hit is not None and hit[0] is w:
            return hit[1]
        policies = self._find_policies(w)
        if len(self._policies_of) >= _LOOKUPS_KEPT:
            self._policies_of.clear()
        self._policies_of[w.uid] = (w, policies)
        return policies

    def _find_policies(self, w: Workload) -> list[Authorization]:
        policies = []
        by_key = self.policy_store.by_key
        for key in self.policy_store.candidate_keys(w):
            policy = by_key.get(key)
            if policy is None:
                # Once per (workload, key): this runs for every connection.
                if (w.uid, key) not in self._warned_unknown:
                    self._warned_unknown.add((w.uid, key))
                    log.warning("workload %s names unknown policy %s, skipping it", w.uid, key)
                continue
            policies.append(policy)
        return policies

    def services_of_workload(self, w: Workload) -> list[Service]:
        found = (self.service_by_key(key) for key, _ in w.services)
        return [s for s in found if s is not None]

    # --- the image the workers read ---------------------------------------------------------------

    def image(self, touched: Touched | None = None) -> list[bytes]:
        """The workloads and services as a compact image (`ztunnel.state.image`), in chunks: all of
        them, or a delta image of the `touched` keys."""
        workloads, services = self.workload_store, self.service_store
        tables = Tables(
            workloads.by_uid,
            workloads.by_addr,
            workloads.by_hostname,
            workloads.by_name,
            services.by_key,
            services.by_vip,
            services.by_hostname,
            services.with_cidr_vips,
            workloads.memberships,
        )
        return encode_image(tables, touched)

    # --- /config_dump ------------------------------------------------------------------------------

    def dump(self) -> dict[str, Any]:
        """JSON-serialisable, in the local config's format; services show the endpoints in use."""
        return {key: render() for key, render in self.dump_deferred().items()}

    def dump_deferred(self) -> dict[str, Callable[[], Any]]:
        """`dump`, each section a function that renders it: what it renders is taken now (the
        workloads, services, their endpoints and policies, immutable), so the rendering may run
        anywhere, later (off the loop: 100,000 workloads take a second)."""
        workloads = self.workloads()
        services = [(s, tuple(self.endpoints(s.key))) for s in self.services()]
        policies = self.policies()
        services_known = self.service_store.by_key
        staged = {
            key: list(eps.values())
            for key, eps in self.workload_store.memberships.items()
            if key not in services_known
        }
        return {
            "workloads": lambda: [workload_to_dict(w) for w in workloads],
            "services": lambda: [service_to_dict(s, eps) for s, eps in services],
            "policies": lambda: [policy_to_dict(p) for p in policies],
            "stagedServices": lambda: {
                key: {ep.workload_uid: endpoint_to_dict(ep) for ep in eps} for key, eps in staged.items()
            },
        }


def demand_arrived(state: ProxyState, key: str) -> Callable[[], bool]:
    """Whether the store now holds what an on-demand `key` names: `network/ip` (a workload, or a
    service by VIP) or `namespace/hostname` (a service, or a workload by hostname)."""
    scope, _, name = key.rpartition("/")
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return lambda: (
            state.service_by_key(key) is not None or state.workload_by_hostname(scope, name) is not None
        )
    return lambda: state.workload_by_addr(scope, ip) is not None or bool(state.services_by_vip(scope, ip))


class Batch:
    """`ProxyState.batch()`: every change is made in one (a plain context manager: a push of 100,000
    workloads enters some 200,000)."""

    __slots__ = ("state",)

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    def __enter__(self) -> None:
        state = self.state
        state._batch_depth += 1
        state._forget_lookups()

    def __exit__(self, *_: object) -> None:
        state = self.state
        state._forget_lookups()
        state._batch_depth -= 1
        if state._batch_depth == 0:
            state._committed()


# Answers kept per lookup between changes of the store (a node's connections name a few addresses).
_LOOKUPS_KEPT = 4096


def _unlist(index: dict[Any, list[str]], where: Any, key: str) -> None:
    keys = index.get(where)
    if keys is None:
        return
    keys[:] = [k for k in keys if k != key]
    if not keys:
        del index[where]


def visible_to(service: Service, client_namespace: str | None) -> bool:
    """Whether a client of `client_namespace` may see `service` (its exportTo, as `visibility`)."""
    return service.visibility is Visibility.PUBLIC or service.namespace == client_namespace


def _preferred(
    candidates: Iterable[Service], client_namespace: str | None, preferred_namespace: str | None = None
) -> Service | None:
    """Among services sharing a VIP or hostname: the client's namespace, then a canonical one, then the
    preferred namespace, then the first seen."""
    visible = [s for s in candidates if visible_to(s, client_namespace)]
    for s in visible:
        if s.namespace == client_namespace:
            return s
    for s in visible:
        if s.canonical:
            return s
    if preferred_namespace:
        for s in visible:
            if s.namespace == preferred_namespace:
                return s
    return visible[0] if visible else None
