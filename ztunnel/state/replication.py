"""The parent's store, replicated to every worker: `Replication`, its messages, and `apply_changes`.

`Replication` is the parent's publishing: it observes the parent's `ProxyState` (it is no kind of
store) and hands each committed change to its `publish` callable. The workloads and services reach
the workers as images (`ztunnel.state.image`) in sealed memfds (`ztunnel.state.memfd`), as
`StateImageReady` with the fd: every worker maps the same pages read-only, so the mesh is held once
per node. After every committed change (one xDS response, the local file, a batch) that touched a
workload or a service, it encodes a delta image of what changed since the base image (the keys
touched, each in full), which replaces the previous delta; once the changes since the base reach a
sixteenth of the store, or the store was replaced, a new base image instead. The policies, few and
read per connection, travel as one `StateChanges` per change, which a worker applies to its store
with `apply_changes`. A worker that starts late gets `snapshot()` first: the policies, then the
current images.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mesh.localconfig import LocalConfig
from mesh.model import Service, Workload
from policy.model import Authorization
from ztunnel.state.image import Touched
from ztunnel.state.memfd import write_image
from ztunnel.state.store import ProxyState

# --- the messages: the policies as changes, the workloads and services as images -------------------


@dataclass(frozen=True)
class Clear:
    """Empty the store (a whole snapshot, or the local file applied again, starts with it)."""


@dataclass(frozen=True)
class UpsertPolicy:
    policy: Authorization


@dataclass(frozen=True)
class RemovePolicy:
    key: str


# The workloads and services travel as images (`StateImageReady`), never as changes.
StateOp = Clear | UpsertPolicy | RemovePolicy


@dataclass(frozen=True)
class StateChanges:
    """Supervisor -> worker: one committed change of the store's policies (a whole snapshot starts
    with Clear)."""

    ops: tuple[StateOp, ...]


@dataclass(frozen=True)
class StateImageReady:
    """Supervisor -> worker, with a sealed memfd: the workloads and services from now on, as an image
    (`ztunnel.state.image`) of `size` bytes the worker maps read-only: a base image, or, with `base`
    (the generation of the base image it applies over), a delta of what changed since that base (it
    replaces the previous delta). `generation` numbers the images."""

    size: int
    generation: int
    base: int | None = None

    @property
    def delta(self) -> bool:
        return self.base is not None


StateMessage = StateChanges | StateImageReady

# A message for every worker, with the fds that go with it (the receiver of an image's fd owns a dup).
Publish = Callable[[StateMessage, Sequence[int]], None]
DELTA_MIN = 512  # workloads and services a delta image may carry, at least, before a new base


class Replication:
    """The parent's publishing: observes its store (`ProxyState.observe`) and hands every committed
    change to `publish`, as images of the workloads and services and as the policies' changes."""

    def __init__(self, state: ProxyState, publish: Publish) -> None:
        self.state = state
        self._publish = publish
        # The batch under way: its policy changes (and a Clear), in order, and whether it changed a
        # workload or a service (then a new image goes out).
        self._policy_ops: list[StateOp] = []
        self._addresses_changed = False
        # (memfd, size, generation) of the workers' current base image and delta image; what the
        # delta holds.
        self._base: tuple[int, int, int] | None = None
        self._delta: tuple[int, int, int] | None = None
        self._touched = Touched()
        self._rebase = True  # the next image is a base (the store was replaced)
        self.generation = 0
        state.observe(self)

    # --- the store's changes, as it makes them ---

    def workload_changed(self, before: Workload | None, after: Workload | None) -> None:
        self._addresses_changed = True
        if self._tracking():
            # The keys of what the store held for it change too (an address left, a membership).
            for w in (before, after):
                if w is not None:
                    self._touched.workload(w)

    def service_changed(self, before: Service | None, after: Service | None) -> None:
        self._addresses_changed = True
        if self._tracking():
            for s in (before, after):
                if s is not None:
                    self._touched.service(s)

    def policy_changed(self, key: str, after: Authorization | None) -> None:
        self._policy_ops.append(RemovePolicy(key) if after is None else UpsertPolicy(after))

    def replaced(self) -> None:
        self._rebase = True
        self._addresses_changed = True
        self._policy_ops.append(Clear())  # then the new policies, one by one

    def committed(self) -> None:
        policies, self._policy_ops = self._policy_ops, []
        addresses, self._addresses_changed = self._addresses_changed, False
        if policies:
            self._publish(StateChanges(tuple(policies)), ())
        if addresses:
            self._publish_image()

    # --- the images ---

    def _delta_limit(self) -> int:
        return max(DELTA_MIN, (len(self.state.workload_store) + len(self.state.service_store)) // 16)

    def _tracking(self) -> bool:
        """Whether the next image may be a delta, so what changes is worth noting."""
        return self._base is not None and not self._rebase and len(self._touched) <= self._delta_limit()

    def _publish_image(self) -> None:
        rebase = not self._tracking()
        fd, size = write_image(self.state.image(None if rebase else self._touched))
        self.generation += 1
        image = (fd, size, self.generation)
        old = [self._delta]
        if rebase:
            old.append(self._base)
            self._base, self._delta, self._touched, self._rebase = image, None, Touched(), False
        else:
            self._delta = image
        self._publish(self._announce(image, delta=not rebase), (fd,))
        for previous in old:
            if previous is not None:
                os.close(previous[0])  # the workers hold their own

    def snapshot(self) -> list[tuple[StateMessage, Sequence[int]]]:
        """What a worker that starts is sent first: the policies, then the current images (if any)."""
        ops: list[StateOp] = [Clear()]
        ops += [UpsertPolicy(p) for p in self.state.policies()]
        return [(StateChanges(tuple(ops)), ()), *self.images()]

    def images(self) -> list[tuple[StateMessage, Sequence[int]]]:
        """The current images (if any): the base, then the delta over it."""
        out: list[tuple[StateMessage, Sequence[int]]] = []
        for image, delta in ((self._base, False), (self._delta, True)):
            if image is not None:
                out.append((self._announce(image, delta), (image[0],)))
        return out

    def _announce(self, image: tuple[int, int, int], delta: bool) -> StateImageReady:
        assert self._base is not None
        return StateImageReady(image[1], image[2], self._base[2] if delta else None)

    def close(self) -> None:
        """Let the current images go (the workers keep what they mapped)."""
        for image in (self._base, self._delta):
            if image is not None:
                os.close(image[0])
        self._base = self._delta = None


def apply_changes(state: ProxyState, changes: StateChanges) -> None:
    """A worker applies one change of the supervisor's policies, with one notification."""
    with state.batch():
        for op in changes.ops:
            if isinstance(op, Clear):
                state.apply_local_config(LocalConfig())
            elif isinstance(op, UpsertPolicy):
                state.upsert_policy(op.policy)
            else:
                state.remove_policy(op.key)
