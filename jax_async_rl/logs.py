"""What a run reports: scalars to TensorBoard, metrics.jsonl and wandb (`Logger`), and the
terminal's progress line (`Progress`). Both may be called from any thread.
"""

import json
import os
import socket
import struct
import sys
import threading
import time
from collections import deque
from typing import Optional

import numpy as np
from tensorboardX.proto import event_pb2, summary_pb2
from tensorboardX.record_writer import masked_crc32c

from jax_async_rl import checkpoints
from jax_async_rl.checkpoints import METRICS


class Logger:
    """TensorBoard events + metrics.jsonl ({"step", "wall_time", "tag", "value"} a line) + wandb.
    `run_dir` None: a process other than 0, which logs nothing.

    Both files are written in the caller's thread, each `log` one write (tensorboardX's writer
    thread would print its own tracebacks on a full disk and again at exit): the first file system
    error is raised once, naming its file, and nothing is written after it. A metrics.jsonl
    deleted mid-run is recreated with a warning, as TensorFlow's EventsWriter recreates its file."""

    def __init__(self, run_dir: Optional[str], args, purge_step: Optional[int] = None):
        """`purge_step` (a resumed run: the checkpoint's step + 1): TensorBoard hides what the
        earlier event files hold from that step on, so that it shows one continuous run."""
        self.run_dir = run_dir
        self.lock = threading.Lock()
        self.failed = False
        self.wandb = None
        if run_dir is None:
            return
        name = os.path.join(
            run_dir, f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        )
        self.events_path = next(
            f"{name}{k or ''}" for k in range(1000) if not os.path.lexists(f"{name}{k or ''}")
        )
        self.events = checkpoints.open_own(
            self.events_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "wb", buffering=0
        )
        first = [event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2")]
        if purge_step is not None:
            first.append(
                event_pb2.Event(
                    step=purge_step,
                    wall_time=time.time(),
                    session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START),
                )
            )
        self.events.write(b"".join(map(record, first)))
        self.path = os.path.join(run_dir, METRICS)
        self.jsonl = append(self.path)
        if args.track:
            import wandb

            self.wandb = wandb.init(
                project=args.wandb_project, config=vars(args), dir=run_dir, resume="allow"
            )

    def log(self, step: int, scalars: dict):
        with self.lock:
            if self.run_dir is None or self.failed:  # another process's, closed, or its disk failed
                return
            now, writing = time.time(), self.path
            try:
                self.recreate(step)
                lines, events = [], []
                for tag, value in scalars.items():
                    value = float(value)
                    summary = summary_pb2.Summary(
                        value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)]
                    )
                    events.append(event_pb2.Event(wall_time=now, step=int(step), summary=summary))
                    lines.append(
                        json.dumps(
                            {"step": int(step), "wall_time": now, "tag": tag, "value": value}
                        )
                        + "\n"
                    )
                self.jsonl.write("".join(lines))
                writing = self.events_path
                self.events.write(b"".join(map(record, events)))
            except OSError as e:  # a full disk names no file
                self.failed, e.filename = True, e.filename or writing
                raise
            if self.wandb is not None:
                self.wandb.log(dict(scalars, global_step=step))

    def recreate(self, step: int):
        """metrics.jsonl again, with a warning, if it was deleted (or replaced) since it was opened
        and its folder is still there (a folder moved mid-run takes the open file with it)."""
        try:
            if os.stat(self.path).st_ino == os.fstat(self.jsonl.fileno()).st_ino:
                return
        except FileNotFoundError:
            if not os.path.isdir(os.path.dirname(self.path)):
                return
        self.jsonl.close()
        self.jsonl = append(self.path)
        print(
            f"warning: {self.path} was deleted mid-run; recreated from step {step} on (the "
            f"records before are in "
            "TensorBoard's events file)",
            file=sys.stderr,
            flush=True,
        )

    def close(self):
        """Both files closed; an error the run has not reported yet is raised (one, naming its
        file)."""
        if self.run_dir is None:
            return
        with self.lock:
            self.run_dir, errors = None, []
            for f, path in ((self.events, self.events_path), (self.jsonl, self.path)):
                try:
                    f.close()  # closed also when its last flush fails
                except OSError as e:
                    e.filename = e.filename or path
                    errors.append(e)
            if self.wandb is not None:
                self.wandb.finish()
            if errors and not self.failed:
                self.failed = True
                raise errors[0]


def append(path: str):
    """`path` opened to append lines, never through a link (a run folder may come from anyone)."""
    return checkpoints.open_own(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "a", buffering=1)


def record(event) -> bytes:
    """An event as a TFRecord (TensorBoard's file format): its length, the length's masked CRC-32C,
    the data, its masked CRC-32C."""
    data = event.SerializeToString()
    header = struct.pack("Q", len(data))
    return (
        header
        + struct.pack("I", masked_crc32c(header))
        + data
        + struct.pack("I", masked_crc32c(data))
    )


class Progress:
    """The terminal line, every `interval` s from a thread of its own, so that it never waits for a
    compile or an update: env steps sampled and learned, SPS (sampled) over the last 30 s since
    the last compile, the mean game score of the last 20 episodes, and the time left.

    The ETA comes from the learner's pace between update completions (`updated`) over the last
    `window` s, and counts only what it has measured. A replay run first fills its buffer up to
    step `learning_from` (its rounds learn nothing and are fast): the line gives the time to
    learning's start, no ETA. The first update, and a replay run's first learning round, compile:
    "compiling" and no SPS (the actor waits) until it ends; the ETA is n/a until a second one."""

    def __init__(
        self,
        total: int,
        counts,
        interval: float = 5.0,
        window: float = 60.0,
        clock=time.time,
        start=True,
        learning_from: int = 0,
    ):
        self.total = total
        self.counts = counts
        self.interval = interval
        self.span = window
        self.clock = clock
        self.learning_from = learning_from
        self.returns = deque(maxlen=20)
        self.window = deque([(clock(), *counts())], maxlen=7)
        self.updates = deque()  # (time, learned) at each learning update's end
        # (time, learned) at the end of the first and the last round that learned nothing
        self.filling = []
        self.round = None  # the steps of a round that learned nothing (the last two apart)
        self.compiled = False  # no compile pending: the update (or the learning round) has run once
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, name="progress", daemon=True)
        if start:
            self.thread.start()

    def updated(self, learned: int):
        """An update ended: `learned` env steps are learned from."""
        with self.lock:
            now = self.clock()
            if learned <= self.learning_from:  # a replay round that filled the buffer
                self.round = learned - self.filling[-1][1] if self.filling else None
                self.filling = [*self.filling[:1], (now, learned)]
            else:
                self.updates.append((now, learned))
                while len(self.updates) > 2 and self.updates[1][0] < now - self.span:
                    self.updates.popleft()
            # a compile just ended: SPS counts from here
            if not self.compiled or len(self.updates) == 1:
                self.window = deque([(now, *self.counts())], maxlen=7)
            self.compiled = not self.compiling()

    def compiling(self) -> bool:
        """Whether the next update compiles: none has ended, or the filling is over and no learning
        update has ended (the next round passes `learning_from`)."""
        if self.updates:
            return False
        return (
            not self.filling
            or self.round is not None
            and self.learning_from - self.filling[-1][1] < self.round
        )

    def eta(self, now: float) -> str:
        with self.lock:
            updates, filling, compiling = list(self.updates), list(self.filling), self.compiling()
        starts = (
            f"learning starts at step {self.learning_from}"
            if self.learning_from < self.total
            else ""
        )
        if compiling and (filling or not self.learning_from):
            return "n/a (compiling the first update)"
        if compiling:
            return f"n/a (compiling; {starts})" if starts else "n/a (compiling)"
        if not updates:  # filling the buffer: its pace says when learning starts, not when it ends
            (t0, learned0), (t1, learned1) = filling[0], filling[-1]
            if t1 <= t0 or learned1 <= learned0:
                return f"n/a ({starts or 'no update learns'})"
            left = (min(self.learning_from, self.total) - learned1) / (
                (learned1 - learned0) / (t1 - t0)
            ) - (now - t1)
            return f"n/a ({starts} in {clock_time(left)})" if starts else clock_time(left)
        (t0, learned0), (t1, learned1) = updates[0], updates[-1]
        if t1 <= t0 or learned1 <= learned0:
            return "n/a"
        return clock_time(
            (self.total - learned1) / ((learned1 - learned0) / (t1 - t0)) - (now - t1)
        )

    def line(self) -> str:
        sampled, learned = self.counts()
        with self.lock:
            self.window.append((self.clock(), sampled, learned))
            (then, sampled_then, _), now = self.window[0], self.window[-1][0]
            known = self.compiled and now - then >= 1.0
        sps = f"{(sampled - sampled_then) / (now - then):7.0f}" if known else f"{'n/a':>7}"
        returns = list(self.returns)
        mean_ret = f"{np.mean(returns):.1f}" if returns else "n/a"
        return (
            f"step {sampled:>10d} sampled {learned:>10d} learned of {self.total}  SPS {sps}  "
            f"return(last 20) {mean_ret}  ETA {self.eta(now)}"
        )

    def run(self):
        while not self.done.wait(self.interval):
            print(self.line(), flush=True)

    def close(self):
        self.done.set()
        if self.thread.is_alive():
            self.thread.join()


def clock_time(seconds: float) -> str:
    """H:MM:SS of a time left (0 once past it)."""
    seconds = max(seconds, 0.0)
    return f"{int(seconds // 3600)}:{int(seconds % 3600 // 60):02d}:{int(seconds % 60):02d}"
