"""Thread plumbing of the asynchronous scripts: what the actor and learner threads share, queues
that give up when the run stops, and the lifetime of a run's threads (an exception in any one
stops all, and is reported: one line for a fault it can name, else its traceback). No call here
waits forever.
"""

import queue
import sys
import threading
import time
import traceback

import numpy as np

from jax_async_rl import devices, folders
from jax_async_rl.flags import describe_os_error, is_file_system_error
from jax_async_rl.gym_pool import EnvError, Stopped
from jax_async_rl.normalize import Normalizer


class Shared:
    """What an asynchronous script's actor and learner threads share besides the queues: the
    parameters the learner published after each update, by version (`publish`, Sample Factory
    §3.4; `latest`, the newest pair, replaced whole, so a reader gets a consistent one; the last
    `keep` versions stay for actors that act with an exact one), the actors' normaliser, the env
    steps each actor thread has sent actions for (`sampled`, the run's counter), the stages'
    timings and the run's `stop`. Left out (in tests), these are a fresh counter and event and a
    normaliser that passes everything."""

    def __init__(
        self,
        params,
        version,
        normalizer=None,
        sampled=None,
        stop=None,
        learning=False,
        keep: int = 2,
        published=None,
    ):
        self.latest, self.keep = (params, int(version)), keep
        self.published = {
            **(published or {}),
            int(version): params,
        }  # published: older ones a resume carried
        # The oldest version the run holds at its start (0; a resume's checkpoint, or the oldest it
        # carried): an actor's schedule never names one before it (acting_version's `oldest`).
        self.oldest = min(self.published)
        self.learning = learning  # a learner publishes updates: actors wait for them (`acting`)
        self.new = threading.Condition()  # notified at each publication
        self.normalizer = normalizer or Normalizer(np.zeros(()), 0, False, False, 0.0)
        self.sampled = np.zeros(1, np.int64) if sampled is None else sampled
        self.stop = stop or threading.Event()
        self.timing = dict.fromkeys(
            ["env", "inference", "bookkeeping", "device_get", "queue_put", "queue_get", "update"],
            0.0,
        )

    def publish(self, params, version: int):
        """The learner's parameters after an update, and their version."""
        with self.new:
            self.published[version] = params
            self.latest = (params, version)
            for old in [v for v in self.published if v <= version - self.keep]:
                del self.published[old]
            self.new.notify_all()

    def acting(self, version: int, exact: bool):
        """(parameters, version) for an actor's step that must see the update that makes `version`
        (its script's schedule): exactly those (`exact`: --deterministic), else the newest once
        they are out. Waits for them with a learner; None when the run stops. RuntimeError for an
        exact version older than every one held: it will never be published (no wait forever)."""
        with self.new:
            while self.learning and not self.stop.is_set():
                if exact and version in self.published:
                    return self.published[version], version
                if exact and version < min(self.published):
                    raise RuntimeError(
                        f"the actor's schedule names parameter version {version}, older than "
                        f"every version the "
                        f"run holds ({min(self.published)}-{self.latest[1]}): it would wait forever"
                    )
                if not exact and self.latest[1] >= version:
                    return self.latest
                self.new.wait(0.1)
        return None if self.stop.is_set() else self.latest


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
        """Run fn(*args) in this thread (the synchronous loop), an exception recorded as a
        thread's is."""
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


def report_errors(errors, ckpt_file: str, global_step: int, env_id: str = "", lock=None) -> bool:
    """Print the threads' errors: one line for another process gone, a file system error, a
    non-finite loss or an env's fault (named with `env_id`; an env's own traceback above it),
    else the traceback. True if the last good checkpoint must stay (a non-finite state, a disk
    that failed, a run that lost a process: nothing more is written). `lock`: the run folder's
    (folders.kept)."""
    kept = folders.kept(ckpt_file, lock)
    keep = traced = False
    for where, error, trace in errors:
        if isinstance(error, EnvError):  # the learning is sound: checkpointed
            if error.details:
                print(error.details.rstrip(), file=sys.stderr)
            print(
                f"error in {where}: --env-id {env_id}: {error.line}; stopped at step "
                f"{global_step}, checkpoint: "
                f"{ckpt_file}",
                file=sys.stderr,
            )
            continue
        if devices.peer_failure(error):
            print(f"error in {where}: {devices.describe_dead(error)}; {kept}", file=sys.stderr)
        elif is_file_system_error(error):
            print(
                f"error in {where}: {describe_os_error(error)} (step {global_step}); {kept}",
                file=sys.stderr,
            )
        elif isinstance(error, FloatingPointError):
            print(
                f"error: {error} (step {global_step}); {kept}. Try a lower --learning-rate or "
                f"--max-grad-norm.",
                file=sys.stderr,
            )
        else:
            print(f"error in {where}:\n{trace}", file=sys.stderr)
            traced = True
            continue
        keep = True
    if traced and not keep:
        print(
            f"stopped by an error at step {global_step}; checkpoint: {ckpt_file}", file=sys.stderr
        )
    return keep
