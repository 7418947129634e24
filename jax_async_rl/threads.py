"""Thread plumbing of the asynchronous scripts: queues that give up when the run stops, and the
lifetime of a run's threads (an exception in any one stops all, and is reported with its
traceback). No call here waits forever.
"""

import queue
import threading
import time
import traceback


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
        self.errors = []
        self.threads = []  # (thread, what it owns: closed once it has ended)

    def start(self, name: str, fn, *args, owns=None) -> threading.Thread:
        """Run fn(*args) in a daemon thread named `name`; `owns` (its envs, say) is closed when it has ended."""

        def target():
            try:
                fn(*args)
            except BaseException as e:
                self.errors.append((name, e, traceback.format_exc()))
                self.stop.set()

        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self.threads.append((thread, owns))
        return thread

    def run(self, name: str, fn, *args):
        """Run fn(*args) in this thread, with a thread's error handling: an exception is recorded."""
        try:
            fn(*args)
        except Exception as e:
            self.errors.append((name, e, traceback.format_exc()))
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
                owned.close()
