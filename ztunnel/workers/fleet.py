"""The fleet: what the supervisor makes of its workers' lives, without I/O or a clock.

The supervisor tells a `Fleet` what happened (a worker was spawned, answered, is ready, is gone;
a heartbeat tick) with the time it happened, and gets back the decisions as values:

* readiness over the workers: the `proxy` readiness task is held (`ReadinessChanged(False)`) until every
  worker's listeners accept, and again whenever one is down: gone, or silent for
  `heartbeat_timeout` (`Unresponsive`), until it answers again (`Answers`);
* `Started` once, the first time every worker is ready: start-up is over;
* restart backoff: a worker that is gone is started again (`Restart(delay)`) after `restart_delay`,
  doubling up to `restart_delay_max` while it keeps dying young (before `stable_after` seconds);
  one that fails at start-up before the fleet ever started stops start-up (`StartupFailed`);
* nothing is restarted once the fleet is stopping.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

RESTART_DELAY = 0.5
RESTART_DELAY_MAX = 10.0
# A worker that ran at least this long before dying is restarted after the shortest delay again.
STABLE_AFTER = 10.0
HEARTBEAT_TIMEOUT = 5.0


class Phase(Enum):
    STARTING = "starting"
    READY = "ready"
    UNRESPONSIVE = "unresponsive"
    RESTARTING = "restarting"
    STOPPED = "stopped"


@dataclass(frozen=True)
class ReadinessChanged:
    """The proxy's readiness changed: hold the `proxy` task (False) or release it (True)."""

    ready: bool


@dataclass(frozen=True)
class Started:
    """Every worker is ready, for the first time."""


@dataclass(frozen=True)
class Unresponsive:
    index: int
    silent_for: float


@dataclass(frozen=True)
class Answers:
    """An unresponsive worker answers again."""

    index: int


@dataclass(frozen=True)
class Restart:
    index: int
    delay: float
    failure: str = ""


@dataclass(frozen=True)
class StartupFailed:
    index: int
    error: str


Event = ReadinessChanged | Started | Unresponsive | Answers | Restart | StartupFailed


@dataclass
class Member:
    index: int
    phase: Phase = Phase.STARTING
    started_at: float = 0.0
    answered: float = 0.0  # when its loop last answered
    restarts: int = 0
    delay: float = RESTART_DELAY  # before its next restart, should it die young


@dataclass
class Fleet:
    count: int
    restart_delay: float = RESTART_DELAY
    restart_delay_max: float = RESTART_DELAY_MAX
    stable_after: float = STABLE_AFTER
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT
    members: list[Member] = field(default_factory=list)
    started: bool = False
    stopping: bool = False
    ready: bool = False  # as last said by a ReadinessChanged event (held at first)

    def __post_init__(self) -> None:
        if not self.members:
            self.members = [Member(i, delay=self.restart_delay) for i in range(self.count)]

    def phase(self, index: int) -> Phase:
        return self.members[index].phase

    # -- what happened ----------------------------------------------------------------------------

    def spawned(self, index: int, now: float) -> list[Event]:
        """Worker `index` was forked (first time or again)."""
        m = self.members[index]
        if m.phase is Phase.RESTARTING:
            m.restarts += 1
        m.phase, m.started_at, m.answered = Phase.STARTING, now, now
        return self._settle()

    def heard(self, index: int, now: float) -> list[Event]:
        """Any message from worker `index`: its loop runs."""
        m = self.members[index]
        m.answered = now
        if m.phase is not Phase.UNRESPONSIVE:
            return []
        m.phase = Phase.READY
        return [Answers(index), *self._settle()]

    def became_ready(self, index: int, now: float) -> list[Event]:
        """Worker `index`'s listeners accept."""
        m = self.members[index]
        m.answered = now
        m.phase = Phase.READY
        events = self._settle()
        if not self.started and all(x.phase is Phase.READY for x in self.members):
            self.started = True
            events.append(Started())
        return events

    def gone(self, index: int, now: float, failure: str = "") -> list[Event]:
        """Worker `index`'s channel closed (it died or exited); `failure` is its start-up error."""
        m = self.members[index]
        if self.stopping:
            m.phase = Phase.STOPPED  # readiness stays as it was while the proxy drains
            return []
        m.phase = Phase.RESTARTING
        events = self._settle()
        if failure and not self.started:
            return [*events, StartupFailed(index, failure)]
        delay = self.restart_delay if now - m.started_at >= self.stable_after else m.delay
        m.delay = min(delay * 2, self.restart_delay_max)  # for the next time, should it die young again
        return [*events, Restart(index, delay, failure)]

    def dropped(self, index: int) -> list[Event]:
        """Worker `index` is not started again (the fleet stops, or its fork failed)."""
        self.members[index].phase = Phase.STOPPED
        return [] if self.stopping else self._settle()

    def tick(self, now: float) -> list[Event]:
        """The heartbeat: a ready worker silent for too long counts as down."""
        events: list[Event] = []
        for m in self.members:
            if m.phase is Phase.READY and now - m.answered > self.heartbeat_timeout:
                m.phase = Phase.UNRESPONSIVE
                events.append(Unresponsive(m.index, now - m.answered))
        return events + self._settle()

    def to_ping(self) -> list[int]:
        """The workers the heartbeat pings (those serving, answering or not)."""
        return [m.index for m in self.members if m.phase in (Phase.READY, Phase.UNRESPONSIVE)]

    def stop(self) -> None:
        """From now on nothing is restarted."""
        self.stopping = True

    def _settle(self) -> list[Event]:
        ready = all(m.phase is Phase.READY for m in self.members)
        if ready == self.ready:
            return []
        self.ready = ready
        return [ReadinessChanged(ready)]
