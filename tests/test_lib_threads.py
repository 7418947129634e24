"""jax_async_rl.threads: no queue call waits forever, an exception in any thread stops them all
with its traceback kept, and joining has one deadline and closes what ended threads own."""

import queue
import threading
import time

import pytest

from jax_async_rl import threads


def test_put_and_get_give_up_once_stop_is_set():
    stop, q = threading.Event(), queue.Queue(maxsize=1)
    assert threads.put(q, 1, stop) and threads.get(q, stop) == 1
    q.put(2)
    timer = threading.Timer(0.3, stop.set)
    timer.start()
    start = time.monotonic()
    assert threads.put(q, 3, stop) is False  # full: blocked until stop
    assert 0.25 < time.monotonic() - start < 3
    empty = queue.Queue()
    assert threads.get(empty, stop) is None


def test_an_exception_in_a_thread_is_recorded_and_stops_the_others():
    lifetime = threads.Threads()
    ran = []

    def waits():
        while not lifetime.stop.wait(0.05):
            pass
        ran.append("stopped")

    def fails():
        raise ValueError("injected")

    waiter = lifetime.start("actor", waits)
    lifetime.start("learner", fails)
    waiter.join(timeout=5)
    assert not waiter.is_alive() and ran == ["stopped"]
    ((name, error, trace),) = lifetime.errors
    assert name == "the learner thread" and isinstance(error, ValueError)
    assert (
        "Traceback (most recent call last)" in trace
        and "in fails" in trace
        and "ValueError: injected" in trace
    )


def test_run_in_this_thread_records_like_a_thread():
    lifetime = threads.Threads()
    lifetime.run("learner", lambda: 1 / 0)
    assert lifetime.stop.is_set() and isinstance(lifetime.errors[0][1], ZeroDivisionError)
    lifetime = threads.Threads()
    lifetime.run("learner", lambda: None)
    assert not lifetime.stop.is_set() and not lifetime.errors


class Owned:
    closed = False

    def close(self):
        self.closed = True


def test_join_has_one_deadline_and_closes_only_what_ended_threads_own():
    lifetime = threads.Threads()
    release = threading.Event()
    stuck, ended = Owned(), Owned()
    lifetime.start(
        "stuck", release.wait, 30, owns=stuck
    )  # ignores stop, as a thread inside an XLA call
    lifetime.start("polite", lifetime.stop.wait, owns=ended)
    start = time.monotonic()
    lifetime.join(0.5)
    assert time.monotonic() - start < 2
    assert ended.closed and not stuck.closed
    release.set()


def test_an_actor_gets_the_newest_parameters_once_its_version_is_out():
    """Shared.acting, free-running: with a learner, an actor thread waits until the version it
    needs is published (0.3 s later here), then takes the newest; None once the run stops.
    Without a learner (tests' actors alone), the newest at once."""
    shared = threads.Shared(params="p7", version=7, learning=True)
    start = time.monotonic()
    assert shared.acting(7, exact=False) == ("p7", 7) and time.monotonic() - start < 0.05
    threading.Timer(0.3, lambda: shared.publish("p8", 8)).start()
    assert shared.acting(8, exact=False) == ("p8", 8) and time.monotonic() - start >= 0.25
    shared.publish("p9", 9)
    assert shared.acting(8, exact=False) == ("p9", 9)  # the newest, not the one asked for
    stopping = threads.Shared(params=None, version=0, learning=True)
    threading.Timer(0.2, stopping.stop.set).start()
    assert stopping.acting(1, exact=False) is None
    start = time.monotonic()
    assert (
        threads.Shared(params="p", version=0).acting(5, exact=False) == ("p", 0)
        and time.monotonic() - start < 0.05
    )


def test_an_exact_actor_gets_exactly_its_version_while_it_is_kept():
    """Shared.acting, --deterministic: exactly the version asked for, also once newer ones are out
    (the last `keep` are kept), waiting for it until it is published."""
    shared = threads.Shared(params="p10", version=10, learning=True, keep=3)
    for v in (11, 12):
        shared.publish(f"p{v}", v)
    assert shared.acting(10, exact=True) == ("p10", 10) and shared.acting(11, exact=True) == (
        "p11",
        11,
    )
    start = time.monotonic()
    threading.Timer(0.3, lambda: shared.publish("p13", 13)).start()
    assert shared.acting(13, exact=True) == ("p13", 13) and time.monotonic() - start >= 0.25
    assert sorted(shared.published) == [11, 12, 13]  # 10 dropped: 3 kept
    assert shared.latest == ("p13", 13)


def test_an_exact_actor_asking_for_a_version_that_will_never_come_is_an_error_not_a_wait():
    """A resumed run holds its checkpoint's version (and what it carried), not the ones before:
    an exact schedule naming an older one (the replay scripts' resume once hung here) fails at
    once, naming the versions held; a version still to come is waited for as before."""
    shared = threads.Shared(params="p10", version=10, learning=True, keep=3, published={9: "p9"})
    assert shared.oldest == 9 and shared.acting(9, exact=True) == ("p9", 9)
    start = time.monotonic()
    with pytest.raises(
        RuntimeError, match="version 8, older than every version the run holds .9-10."
    ):
        shared.acting(8, exact=True)
    assert time.monotonic() - start < 0.05
    assert threads.Shared(params="p0", version=0).oldest == 0
