"""Ctrl-C and SIGTERM for a run (`Signals`): a clean stop with a checkpoint once the run has
started, an immediate exit before it (the main thread may be inside an XLA compile then)."""

import os
import signal
import sys
import threading

from jax_async_rl import folders, tasks


class Signals:
    """Ctrl-C and SIGTERM. The handler records the signal and sets `stop`: the run stops cleanly,
    writes a checkpoint and exits 128 + signal. Before `started` (the first update) there is
    nothing to save, and the main thread may be inside an XLA compile that Python cannot
    interrupt: a thread woken through `signal.set_wakeup_fd` then exits at once, no traceback,
    removing what a new run wrote (`new_run`: its folder, and what the folder held before), which
    holds nothing to resume from and would stop the same command from starting again. While the
    run lasts, a user env's pool gives up waiting on `stop` too (tasks.RUN_STOP)."""

    def __init__(self):
        self.received = []
        self.stop = threading.Event()
        self.started = threading.Event()
        self.new_run = None
        tasks.RUN_STOP[0] = self.stop
        self.handlers = {
            s: signal.signal(s, self.on_signal) for s in (signal.SIGINT, signal.SIGTERM)
        }
        self.read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self.previous_fd = signal.set_wakeup_fd(write_fd)
        self.watcher = threading.Thread(target=self.watch, name="signals", daemon=True)
        self.watcher.start()

    def on_signal(self, signum, frame):
        self.received.append(signum)
        self.stop.set()

    def watch(self):
        while True:
            data = os.read(self.read_fd, 1)  # one byte per signal; b"" once `close` runs
            if not data:
                break
            if not self.started.is_set():
                if self.new_run:
                    folders.remove_new(*self.new_run)
                print(
                    f"stopped by signal {data[0]} during start-up: nothing to save",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(128 + data[0])

    def close(self):
        tasks.RUN_STOP[0] = None
        os.close(signal.set_wakeup_fd(self.previous_fd))
        self.watcher.join()
        os.close(self.read_fd)
        for signum, handler in self.handlers.items():
            signal.signal(signum, handler)
