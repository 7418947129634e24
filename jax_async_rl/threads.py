"""Thread plumbing of the asynchronous scripts: what the actor and learner threads share, queues
that give up when the run stops, and the lifetime of a run's threads (an exception in any one
stops all, and is reported with its traceback). No call here waits forever.
"""

import queue
import threading
import time
import traceback

import numpy as np

from jax_async_rl.normalize import Normalizer


class Stopped(Exception):
    """A blocking call gave up because the run stops (a user env's `recv`): not an error, the
    thread just ends."""


class Shared:
    """What an asynchronous script's actor and learner threads share besides the queues: the newest
    parameters and their version (`latest`, published by the learner after each update, Sample
    Factory §3.4; replaced whole, so a reader gets a consistent pair), the actors' normaliser, the
    env steps each actor thread has sent actions for (`sampled`, the run's counter), the stages'
    timings, the run's `stop` and `report(games)` (runs.Run.report_episodes). Left out (in tests),
    these are a fresh counter and event, a normaliser that passes everything, and no reports."""

    def __init__(self, params, version, normalizer=None, sampled=None, stop=None, report=None, learning=False,
                 lag_one=False):
        self.latest = (params, int(version))
        self.learning = learning  # a learner publishes updates: actors wait for them (wait_to_act)
        self.lag_one, self.first = lag_one, {}  # first: the version of each actor thread's first step
        self.normalizer = normalizer or Normalizer(np.zeros(()), 0, False, False, 0.0)
        self.sampled = np.zeros(1, np.int64) if sampled is None else sampled
        self.stop = stop or threading.Event()
        self.report = report or (lambda games: None)
        self.timing = dict.fromkeys(["env", "inference", "bookkeeping", "device_get", "queue_put", "queue_get", "update"], 0.0)

    def wait_to_act(self, thread: int, rollout: int, pushed: int) -> bool:
        """Actor thread `thread` is about to act on a step of its rollout number `rollout` (counted
        from 0 as it started), having queued `pushed` rollouts. With a learner, wait until it has
        published the updates that step must see, counted from the version of the thread's first
        step:
        - from rollout 1 on, the update on rollout 0. That update compiles, for seconds in which
          the actor would otherwise sample with the initial parameters until the queue is full
          (queue plus one in flight: 4 rollouts of them, where the sync baseline samples 1;
          MiniGrid-Empty took APPO 1.45x sync's steps to 0.9 for that alone);
        - with `lag_one` (--lag-one, Cleanba's actor), from rollout m >= 2 on, the update on
          rollout m - 2: rollout m is then one update old when the learner takes it, where a full
          queue makes it --queue-size + 1 old. While the learner is the bottleneck that rollout
          would only have waited in the queue; while the actor is, the update is already there.
        Never an update on a rollout not queued yet (with splits, an env may start rollout m
        before another ends rollout m - 1). False when the run stops."""
        first = self.first.setdefault(thread, self.latest[1])
        need = max(min(rollout, 1), rollout - 1) if self.lag_one else min(rollout, 1)
        while self.learning and self.latest[1] < first + min(need, pushed) and not self.stop.is_set():
            time.sleep(0.005)
        return not self.stop.is_set()


def put(q, item, stop) -> bool:
    """queue.put that gives up when `stop` is set: no call waits forever."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            pass
    return False


def get(q, stop):
    """queue.get that returns None when `stop` is set: no call waits forever."""
    while not stop.is_set():
        try:
            return q.get(timeout=0.1)
        except queue.Empty:
            pass
    return None


class Threads:
    """The threads of a run (Stoix's ThreadLifetime): `stop` ends them all; an exception in one is
    recorded in `errors` as (thread name, exception, formatted traceback) and sets `stop`."""

    def __init__(self, stop=None):
        self.stop = stop or threading.Event()
        self.errors = []  # (where: "the actor thread", ..., the exception, its formatted traceback)
        self.threads = []  # (thread, what it owns: closed once it has ended)

    def start(self, name: str, fn, *args, owns=None) -> threading.Thread:
        """Run fn(*args) in a daemon thread named `name`; `owns` (its envs, say: one or a list) is
        closed when it has ended."""

        def target():
            try:
                fn(*args)
            except Stopped:
                pass
            except BaseException as e:
                self.errors.append((f"the {name} thread", e, traceback.format_exc()))
                self.stop.set()

        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self.threads.append((thread, owns))
        return thread

    def run(self, name: str, fn, *args):
        """Run fn(*args) in this thread (the synchronous loop), an exception recorded as a thread's is."""
        try:
            fn(*args)
        except Stopped:
            pass
        except Exception as e:
            self.errors.append((f"the {name}", e, traceback.format_exc()))
            self.stop.set()

    def join(self, seconds: float):
        """Set `stop` and wait for every thread, one deadline for all, then close what the ended
        ones own; a thread stuck in an XLA call is left to os._exit (flags.command_line)."""
        self.stop.set()
        deadline = time.time() + seconds
        for thread, _ in self.threads:
            thread.join(timeout=max(0.0, deadline - time.time()))
        for thread, owned in self.threads:
            if owned is not None and not thread.is_alive():
                for item in owned if isinstance(owned, list) else [owned]:
                    item.close()
