"""The blocking client's alarms (first-chunk watchdogs, call watches): one thread fires every
alarm of a client, in deadline order, never one that was disarmed, none after close. Real
threads; every wait is for a condition (an alarm firing), bounded."""

from __future__ import annotations

import threading

from consumer_support import no_thread_starts

from kvpark.client._alarms import Alarms

BOUND_S = 10.0  # how long a test waits for an alarm that must fire


def test_an_alarm_fires_once_its_delay_is_over() -> None:
    alarms = Alarms()
    rang = threading.Event()
    alarm = alarms.arm(0.01, rang.set)
    assert rang.wait(BOUND_S) and alarm.fired
    alarms.close()


def test_no_delay_means_no_alarm() -> None:
    alarms = Alarms()
    alarm = alarms.arm(None, lambda: None)
    alarms.disarm(alarm)
    assert not alarm.fired
    alarms.close()


def test_alarms_fire_in_deadline_order_and_a_disarmed_one_never() -> None:
    """The later alarm is armed first and the earliest one is disarmed: by the time the last
    one fires, every earlier deadline has passed, so what fired before it is all that will."""
    alarms = Alarms()
    order: list[str] = []
    last = threading.Event()
    alarms.arm(1.0, lambda: (order.append("late"), last.set()))
    alarms.arm(0.5, lambda: order.append("middle"))
    disarmed = alarms.arm(0.4, lambda: order.append("disarmed"))  # disarmed long before due
    alarms.disarm(disarmed)
    assert last.wait(BOUND_S)
    assert order == ["middle", "late"] and not disarmed.fired
    alarms.close()


def test_one_thread_serves_every_alarm_and_ends_on_close() -> None:
    alarms = Alarms()
    before = {t for t in threading.enumerate() if t.name == "kvpark-alarms"}
    rang = threading.Event()
    for _ in range(100):
        alarms.disarm(alarms.arm(60, lambda: None))
    alarms.arm(0.01, rang.set)
    assert rang.wait(BOUND_S)
    started = {t for t in threading.enumerate() if t.name == "kvpark-alarms"} - before
    assert len(started) == 1
    late = alarms.arm(60, lambda: None)
    alarms.close()
    (thread,) = started
    thread.join(BOUND_S)
    assert not thread.is_alive() and not late.fired
    assert not alarms.arm(0.01, lambda: None).fired  # after close: never armed


def test_alarms_armed_while_no_thread_can_start_fire_once_one_can() -> None:
    """No thread to be had (a pids limit): arming does not fail the load that arms; the alarm
    waits, and fires once a later arm gets the thread started."""
    alarms = Alarms()
    early, late = threading.Event(), threading.Event()
    with no_thread_starts("kvpark-alarms") as refused:
        waited = alarms.arm(0.01, early.set)
    assert refused.is_set()
    alarms.arm(0.01, late.set)
    assert early.wait(BOUND_S) and late.wait(BOUND_S) and waited.fired
    alarms.close()
