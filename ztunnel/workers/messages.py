"""Every message that crosses a process boundary of `ztunnel proxy`, as typed values.

They cross only socket pairs between a parent and the processes it forked (the same program), so
pickle is the codec (`channel.py`): the model's frozen dataclasses travel as they are, with no second
schema. Three conversations:

* the supervisor and a worker: `Spawn` first (the worker starts), then the store (the workloads and
  services as an image in shared memory, `StateImageReady`, sent again on `StateImageWanted`; the
  policies as `StateChanges`),
  `Synced`, certificates (`CertificateRequest` -> `CertificateReply`), pods with their namespace fd (`PodAdd`, `PodDel` ->
  `PodResult`), counters (`Scrape` -> `Counters`), profiles, the log filter, `Ping` -> `Pong`, `Stop`;
* a worker's start-up: `Ready` or `Failed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hbone.identity import Identity
from hbone.tls import WorkloadCertificate
from ztunnel.state.replication import Clear as Clear
from ztunnel.state.replication import RemovePolicy as RemovePolicy
from ztunnel.state.replication import StateChanges as StateChanges
from ztunnel.state.replication import StateImageReady as StateImageReady
from ztunnel.state.replication import StateOp as StateOp
from ztunnel.state.replication import UpsertPolicy as UpsertPolicy

# -- a worker's start ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Spawn:
    """Supervisor -> worker, its first message: start as worker `index` (bind, then serve on `Synced`).
    `layout` names the records of the parent's state images (`ztunnel.state.image.LAYOUT`): a
    replacement of another build, which reads other records, refuses to start (`Failed`)."""

    index: int
    layout: int = 0


# -- the store: its messages are its replication's (`ztunnel.state.replication`) ----------------


@dataclass(frozen=True)
class StateImageWanted:
    """Worker -> supervisor: state image `refused` could not be read (or was a delta over a base it
    does not hold: it holds `holding`); send the current images again. The worker keeps serving from
    what it holds meanwhile."""

    refused: int
    holding: int
    reason: str


@dataclass(frozen=True)
class Synced:
    """Supervisor -> worker: the first state of every xDS type is in; the listeners may accept."""


# -- certificates -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CertificateRequest:
    """Worker -> supervisor: the identity's certificate; `known` is the leaf the worker already has."""

    identity: Identity
    known: bytes | None


@dataclass(frozen=True)
class CertificateReply:
    identity: Identity
    certificate: WorkloadCertificate | None
    error: str = ""


@dataclass(frozen=True)
class Demand:
    """Worker -> supervisor, with on-demand xDS: ask the control plane for `key` (`network/ip` or
    `namespace/hostname`); answered once it is in the store (its changes reach the worker first)."""

    seq: int
    key: str


@dataclass(frozen=True)
class DemandReply:
    seq: int
    answered: bool  # False: the control plane did not answer in time


# -- pods (in-pod mode) -------------------------------------------------------------------------


@dataclass(frozen=True)
class PodAdd:
    """Supervisor -> worker, with the pod's network namespace fd: run this pod's proxy."""

    uid: str
    name: str
    namespace: str
    service_account: str
    netns_key: tuple[int, int]
    seq: int = 0  # echoed in the PodResult; 0: nobody waits for it


@dataclass(frozen=True)
class PodDel:
    """Supervisor -> worker: drain this pod's proxy (gracefully for up to `deadline`, at once when
    0); `deleted`: the pod is gone, its connections are ended at once, gracefully."""

    uid: str
    deadline: float = 0.0
    seq: int = 0
    deleted: bool = False


@dataclass(frozen=True)
class PodResult:
    """Worker -> supervisor: the outcome of a PodAdd ("" = listening) or a PodDel."""

    uid: str
    error: str = ""
    seq: int = 0


# -- observation --------------------------------------------------------------------------------

# A traffic snapshot (`counters.traffic_snapshot`): {family: {"type", "help", "samples"}}.
Snapshot = dict[str, Any]
# Each pod's open connections in one worker, as `workloadState` lists them: uid -> direction -> list.
PodConnections = dict[str, dict[str, list[dict[str, str | None]]]]


@dataclass(frozen=True)
class Scrape:
    seq: int


@dataclass(frozen=True)
class Counters:
    """Worker -> supervisor: the worker's traffic counters (as asked by Scrape `seq`, or 0: pushed)."""

    seq: int
    families: Snapshot
    # Only an answer to a scrape lists the pods' connections (None: a periodic push says nothing).
    pods: PodConnections | None = None


@dataclass(frozen=True)
class ProfileRequest:
    """Supervisor -> worker: sample this process (`kind` "cpu" or "heap") for `seconds`."""

    seq: int
    kind: str
    seconds: float
    frequency: int = 0


@dataclass(frozen=True)
class ProfileReply:
    """Worker -> supervisor: the profile (`Profile.as_dict()`), or why there is none."""

    seq: int
    profile: dict[str, Any] | None
    error: str = ""


@dataclass(frozen=True)
class SetLogFilter:
    """Supervisor -> worker: the log filter now in force (set over the admin `/logging`)."""

    spec: str


# -- life cycle ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ping:
    """Supervisor -> worker, every second: a worker whose loop does not answer for a while is down."""


@dataclass(frozen=True)
class Pong:
    pass


@dataclass(frozen=True)
class Ready:
    """Worker -> supervisor: every listener of the worker accepts."""


@dataclass(frozen=True)
class Failed:
    """Worker -> supervisor: start-up failed (the worker exits)."""

    error: str


@dataclass(frozen=True)
class Stop:
    deadline: float


ToWorker = (
    Spawn
    | StateChanges
    | StateImageReady
    | Synced
    | CertificateReply
    | DemandReply
    | PodAdd
    | PodDel
    | Scrape
    | ProfileRequest
    | SetLogFilter
    | Ping
    | Stop
)
FromWorker = (
    CertificateRequest
    | Demand
    | PodResult
    | Counters
    | ProfileReply
    | Pong
    | Ready
    | Failed
    | StateImageWanted
)
