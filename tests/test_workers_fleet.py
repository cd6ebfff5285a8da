"""The fleet as transcripts: what happened to which worker and when, in; decisions out.

No processes and no sleeps: the clock is the `now` of each step."""

from __future__ import annotations

from ztunnel.workers.fleet import (
    Answers,
    Event,
    Fleet,
    Phase,
    ReadinessChanged,
    Restart,
    Started,
    StartupFailed,
    Unresponsive,
)


def test_the_proxy_is_ready_once_every_worker_is_and_start_up_ends_once() -> None:
    fleet = Fleet(2)
    assert not fleet.ready  # held from the start
    assert fleet.spawned(0, 0.0) == []
    assert fleet.spawned(1, 0.0) == []
    assert fleet.became_ready(0, 0.5) == []  # one of two
    assert fleet.became_ready(1, 0.6) == [ReadinessChanged(True), Started()]
    assert fleet.gone(1, 20.0) == [ReadinessChanged(False), Restart(1, 0.5)]
    assert fleet.phase(1) is Phase.RESTARTING
    assert fleet.spawned(1, 20.5) == []
    assert fleet.became_ready(1, 21.0) == [ReadinessChanged(True)]  # no second Started
    assert fleet.members[1].restarts == 1 and fleet.members[0].restarts == 0


def test_a_worker_that_keeps_dying_young_waits_longer_each_time_up_to_the_cap() -> None:
    fleet = Fleet(1)
    fleet.spawned(0, 0.0)
    fleet.became_ready(0, 0.1)
    delays = []
    now = 0.1
    for _ in range(8):
        now += 1.0  # dies a second after its start
        events = fleet.gone(0, now)
        restart = [e for e in events if isinstance(e, Restart)]
        delays.append(restart[0].delay)
        now += restart[0].delay
        fleet.spawned(0, now)
        fleet.became_ready(0, now)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    # After running 10 s it counts as stable: the shortest delay again, then doubling anew.
    now += 10.0
    assert fleet.gone(0, now)[-1] == Restart(0, 0.5)
    fleet.spawned(0, now + 0.5)
    assert fleet.gone(0, now + 1.0)[-1] == Restart(0, 1.0)
    assert fleet.members[0].restarts == 9


def test_a_start_up_failure_before_the_fleet_started_stops_start_up() -> None:
    fleet = Fleet(2)
    fleet.spawned(0, 0.0)
    fleet.spawned(1, 0.0)
    fleet.became_ready(0, 0.2)
    assert fleet.gone(1, 0.3, "failed to bind the proxy listeners: [::]:15001: in use") == [
        StartupFailed(1, "failed to bind the proxy listeners: [::]:15001: in use")
    ]


def test_a_failure_after_start_up_is_restarted_and_named() -> None:
    fleet = Fleet(1)
    fleet.spawned(0, 0.0)
    fleet.became_ready(0, 0.1)
    assert fleet.gone(0, 30.0, "boom") == [ReadinessChanged(False), Restart(0, 0.5, "boom")]


def test_a_silent_worker_is_down_until_it_answers_and_pings_go_to_serving_workers() -> None:
    fleet = Fleet(2)
    fleet.spawned(0, 0.0)
    fleet.spawned(1, 0.0)
    assert fleet.to_ping() == []  # nobody serves yet
    fleet.became_ready(0, 1.0)
    fleet.became_ready(1, 1.0)
    assert fleet.to_ping() == [0, 1]
    assert fleet.tick(5.0) == []
    fleet.heard(0, 5.5)
    assert fleet.tick(6.0) == []  # 1 has been silent exactly 5 s: not yet
    assert fleet.tick(6.5) == [Unresponsive(1, 5.5), ReadinessChanged(False)]
    assert fleet.tick(7.5) == []  # said once
    assert fleet.to_ping() == [0, 1]  # still pinged
    assert fleet.heard(1, 8.0) == [Answers(1), ReadinessChanged(True)]
    assert fleet.heard(1, 8.1) == []


def test_nothing_is_restarted_and_readiness_stays_while_the_fleet_stops() -> None:
    fleet = Fleet(2)
    for i in (0, 1):
        fleet.spawned(i, 0.0)
        fleet.became_ready(i, 0.1)
    fleet.stop()
    events: list[Event] = fleet.gone(0, 30.0) + fleet.gone(1, 30.0)
    assert events == []
    assert [fleet.phase(i) for i in (0, 1)] == [Phase.STOPPED, Phase.STOPPED]


def test_a_restart_abandoned_leaves_the_proxy_unready() -> None:
    fleet = Fleet(1)
    fleet.spawned(0, 0.0)
    fleet.became_ready(0, 0.1)
    fleet.gone(0, 30.0)
    assert fleet.dropped(0) == []  # unready since it went
    assert fleet.phase(0) is Phase.STOPPED and not fleet.ready
