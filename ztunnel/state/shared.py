"""A worker's store: the workloads and services read in place from the parent's image, the policies
held as values.

`SharedState` is a `ProxyState` whose tables of workloads and services are a `StateImage` (a
read-only mapping the parent made, shared by every worker: `ztunnel.state.image`); the rules on top
(which workload wins an address, which service a client sees, the endpoints in use) are the store's
own. Policies stay values applied as changes (they are few and admission reads them per connection).
A new image replaces the old one as one change: the listeners are notified, and the answers kept
between changes are forgotten.
"""

from __future__ import annotations

from collections.abc import Iterable

from xds.model import Endpoint, IPAddress, Service, Workload
from ztunnel.state.image import StateImage
from ztunnel.state.store import Demander, ProxyState

_EMPTY = StateImage(b"".join(ProxyState().image()))


class SharedState(ProxyState):
    def __init__(self, demander: Demander | None = None) -> None:
        super().__init__(demander)
        self.shared: StateImage = _EMPTY

    def install(self, image: StateImage) -> None:
        """Read the workloads and services from `image` from now on (the old one is let go)."""
        with self.batch():
            self.shared = image
            self._changed = True

    # --- the tables, from the image ---

    def workloads(self) -> list[Workload]:
        return list(self.shared.workloads())

    def services(self) -> list[Service]:
        return list(self.shared.services())

    def workload_by_uid(self, uid: str) -> Workload | None:
        return self.shared.workload_by_uid(uid)

    def _workloads_at(self, network: str, ip: IPAddress) -> list[Workload]:
        return self.shared.workloads_at(network, ip)

    def workload_by_hostname(self, namespace: str, hostname: str) -> Workload | None:
        found = self.shared.workloads_by_hostname(namespace, hostname)
        return found[0] if found else None

    def services_by_vip(self, network: str, ip: IPAddress) -> list[Service]:
        return self.shared.services_at(network, ip)

    def service_by_key(self, key: str) -> Service | None:
        return self.shared.service_by_key(key)

    def _services_named(self, hostname: str) -> list[Service]:
        return self.shared.services_by_hostname(hostname)

    def _cidr_services(self) -> Iterable[Service]:
        return self.shared.services_with_cidr_vips()

    def _memberships_of(self, service_key: str) -> Iterable[Endpoint]:
        return self.shared.memberships(service_key)

    def _local_candidates(self, name: str, namespace: str) -> Iterable[Workload]:
        return self.shared.workloads_named(namespace, name)

    def series_names_present(self, keys: set[tuple[str, str]]) -> set[tuple[str, str]]:
        return {key for key in keys if self.shared.has_series_name(*key)}
