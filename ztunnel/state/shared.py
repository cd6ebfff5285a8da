"""A worker's view of the mesh: the workloads and services read in place from the parent's images.

`ImageView` answers the store's table reads (`ztunnel.state.store.MeshTables`) from the parent's
images (read-only mappings shared by every worker: `ztunnel.state.image`): a key the delta image
touched is answered by it, any other by the base image. A worker's store is a `ProxyState` over it
(`worker_state`): the rules on top (which workload wins an address, which service a client sees, the
endpoints in use) are the store's own, the policies its values, applied as changes (they are few and
admission reads them per connection). A new image replaces the old one as one change (`install`):
the listeners are notified, and the answers kept between changes are forgotten.
"""

from __future__ import annotations

from collections.abc import Iterable

from mesh.model import Endpoint, IPAddress, Service, Workload
from ztunnel.state.image import StateImage, addr_key, pair_key
from ztunnel.state.store import Demander, ProxyState

_EMPTY = StateImage(b"".join(ProxyState().image()))


def worker_state(demander: Demander | None = None) -> tuple[ProxyState, ImageView]:
    """A worker's store, and the view of the parent's images it reads (empty until `install`)."""
    view = ImageView()
    return ProxyState(demander, tables=view), view


def install(
    state: ProxyState, view: ImageView, image: StateImage, generation: int = 0, base: int | None = None
) -> bool:
    """`view.install`, as one change of `state` (its listeners told, its kept answers forgotten)."""
    with state.batch():
        if not view.install(image, generation, base):
            return False
        state.tables_changed()
    return True


class ImageView:
    """The parent's base image and the delta over it, read as the store's `MeshTables`."""

    def __init__(self) -> None:
        self.shared: StateImage = _EMPTY  # the base image
        self.base_generation = 0
        self.delta: StateImage | None = None  # what changed since the base, key by key

    def install(self, image: StateImage, generation: int = 0, base: int | None = None) -> bool:
        """Read the workloads and services from `image` from now on: a base image (the delta is
        let go with the old base), or a delta over base image `base` (in place of the previous
        delta). A delta over another base than the one held is refused (False): the view stays as
        it was, whole, rather than a mix."""
        if base is not None and base != self.base_generation:
            return False
        if base is not None:
            self.delta = image
        else:
            self.shared, self.delta, self.base_generation = image, None, generation
        return True

    def _image(self, index: str, key: bytes) -> StateImage:
        """The image that answers `key` of `index`: the delta if it touched it, else the base."""
        delta = self.delta
        return delta if delta is not None and delta.touches(index, key) else self.shared

    def _changed_since_base(self, uid: str) -> bool:
        return self.delta is not None and self.delta.touches("uid", uid.encode())

    # --- the tables, from the images ---

    def workloads(self) -> list[Workload]:
        """Every workload (those changed since the base last)."""
        found = [w for w in self.shared.workloads() if not self._changed_since_base(w.uid)]
        if self.delta is not None:
            found += [w for w in self.delta.workloads() if self._changed_since_base(w.uid)]
        return found

    def services(self) -> list[Service]:
        """Every service (those changed since the base last)."""
        delta = self.delta
        if delta is None:
            return list(self.shared.services())
        found = [s for s in self.shared.services() if not delta.touches("key", s.key.encode())]
        return found + [s for s in delta.services() if delta.touches("key", s.key.encode())]

    def workload_by_uid(self, uid: str) -> Workload | None:
        return self._image("uid", uid.encode()).workload_by_uid(uid)

    def workloads_at(self, network: str, ip: IPAddress) -> list[Workload]:
        return self._image("addr", addr_key(network, ip)).workloads_at(network, ip)

    def workload_by_hostname(self, namespace: str, hostname: str) -> Workload | None:
        found = self._image("host", pair_key(namespace, hostname)).workloads_by_hostname(namespace, hostname)
        return found[0] if found else None

    def services_at(self, network: str, ip: IPAddress) -> list[Service]:
        return self._image("vip", addr_key(network, ip)).services_at(network, ip)

    def service_by_key(self, key: str) -> Service | None:
        return self._image("key", key.encode()).service_by_key(key)

    def services_named(self, hostname: str) -> list[Service]:
        return self._image("svchost", hostname.encode()).services_by_hostname(hostname)

    def cidr_services(self) -> Iterable[Service]:
        return (self.delta or self.shared).services_with_cidr_vips()

    def memberships(self, service_key: str) -> Iterable[Endpoint]:
        return self._image("member", service_key.encode()).memberships(service_key)

    def local_candidates(self, name: str, namespace: str) -> Iterable[Workload]:
        found = [
            w for w in self.shared.workloads_named(namespace, name) if not self._changed_since_base(w.uid)
        ]
        return found + (self.delta.workloads_named(namespace, name) if self.delta is not None else [])

    def workloads_by_name(self, name: str) -> list[Workload]:
        return self._image("pod", name.encode()).workloads_of_pod_name(name)

    def series_names_present(self, keys: set[tuple[str, str]]) -> set[tuple[str, str]]:
        return {key for key in keys if self._has_series_name(*key)}

    def _has_series_name(self, namespace: str, name: str) -> bool:
        if self.delta is not None and self.delta.series_named(namespace, name):
            return True
        return any(not self._changed_since_base(w.uid) for w in self.shared.series_named(namespace, name))
