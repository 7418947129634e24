"""jax_async_rl.threads: no queue call waits forever, an exception in any thread stops them all
with its traceback kept, and joining has one deadline and closes what ended threads own."""

import queue
import threading
import time

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
    (name, error, trace), = lifetime.errors
    assert name == "the learner thread" and isinstance(error, ValueError)
    assert "Traceback (most recent call last)" in trace and "in fails" in trace and "ValueError: injected" in trace


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
    lifetime.start("stuck", release.wait, 30, owns=stuck)  # ignores stop, as a thread inside an XLA call
    lifetime.start("polite", lifetime.stop.wait, owns=ended)
    start = time.monotonic()
    lifetime.join(0.5)
    assert time.monotonic() - start < 2
    assert ended.closed and not stuck.closed
    release.set()


def test_an_actor_waits_for_the_first_update_only_with_a_learner():
    """wait_to_act: with a learner, an actor thread acting on rollout 1 or later waits until the
    learner publishes the update after the thread's first version (0.3 s later here), once rollout
    0 is queued; never again; False once the run stops. Without a learner (tests' actors alone),
    at once."""
    shared = threads.Shared(params=None, version=7, learning=True)
    start = time.monotonic()
    assert shared.wait_to_act(0, 0, 0) and shared.wait_to_act(0, 1, 0)  # rollout 0 not queued yet
    assert time.monotonic() - start < 0.05
    threading.Timer(0.3, lambda: setattr(shared, "latest", (None, 8))).start()
    assert shared.wait_to_act(0, 1, 1) and time.monotonic() - start >= 0.25
    start = time.monotonic()
    assert shared.wait_to_act(0, 2, 1) and shared.wait_to_act(0, 9, 8) and time.monotonic() - start < 0.05
    stopping = threads.Shared(params=None, version=0, learning=True)
    threading.Timer(0.2, stopping.stop.set).start()
    assert stopping.wait_to_act(0, 1, 1) is False
    start = time.monotonic()
    assert threads.Shared(params=None, version=0).wait_to_act(0, 1, 1) and time.monotonic() - start < 0.05


def test_lag_one_waits_for_the_update_on_the_rollout_two_before():
    """--lag-one: acting on rollout m >= 2, an actor thread waits until the learner has published
    the update on rollout m - 2, counted per thread from the version of its first step (a
    resumed run's, here 10), and never for an update on a rollout it has not queued."""
    shared = threads.Shared(params=None, version=10, learning=True, lag_one=True)
    assert shared.wait_to_act(0, 0, 0)  # thread 0 starts at 10
    shared.latest = (None, 12)
    assert shared.wait_to_act(1, 0, 0)  # thread 1 starts at 12
    start = time.monotonic()
    assert shared.wait_to_act(0, 3, 3) and shared.wait_to_act(0, 5, 2)  # need 10 + 2, 10 + min(4, 2)
    assert time.monotonic() - start < 0.05
    for thread, rollout, pushed, target in [(1, 1, 1, 13), (0, 5, 4, 14), (1, 4, 3, 15)]:
        threading.Timer(0.3, lambda: setattr(shared, "latest", (None, target))).start()
        start = time.monotonic()
        assert shared.wait_to_act(thread, rollout, pushed) and time.monotonic() - start >= 0.25, (thread, rollout)
