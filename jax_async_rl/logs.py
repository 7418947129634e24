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
        self.run_dir, self.lock, self.failed, self.wandb = run_dir, threading.Lock(), False, None
        if run_dir is None:
            return
        name = os.path.join(run_dir, f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}")
        self.events_path = next(f"{name}{k or ''}" for k in range(1000) if not os.path.exists(f"{name}{k or ''}"))
        self.events = open(self.events_path, "wb", buffering=0)
        first = [event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2")]
        if purge_step is not None:
            first.append(event_pb2.Event(step=purge_step, wall_time=time.time(),
                                         session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
        self.events.write(b"".join(map(record, first)))
        self.path = os.path.join(run_dir, METRICS)
        self.jsonl = open(self.path, "a", buffering=1)
        if args.track:
            import wandb

            self.wandb = wandb.init(project=args.wandb_project, config=vars(args), dir=run_dir, resume="allow")

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
                    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)])
                    events.append(event_pb2.Event(wall_time=now, step=int(step), summary=summary))
                    lines.append(json.dumps({"step": int(step), "wall_time": now, "tag": tag, "value": value}) + "\n")
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
        self.jsonl = open(self.path, "a", buffering=1)
        print(f"warning: {self.path} was deleted mid-run; recreated from step {step} on (the records before are in "
              "TensorBoard's events file)", file=sys.stderr, flush=True)

    def close(self):
        """Both files closed; an error the run has not reported yet is raised (one, naming its file)."""
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


def record(event) -> bytes:
    """An event as a TFRecord (TensorBoard's file format): its length, the length's masked CRC-32C,
    the data, its masked CRC-32C."""
    data = event.SerializeToString()
    header = struct.pack("Q", len(data))
    return header + struct.pack("I", masked_crc32c(header)) + data + struct.pack("I", masked_crc32c(data))


class Progress:
    """The terminal line, every `interval` s from a thread of its own, so that it never waits for a
    compile or an update: env steps sampled and learned, SPS (sampled) over the last 30 s, the
    mean game score of the last 20 episodes, and the time left. The ETA comes from the learner's
    pace between update completions (`updated`) over the last `window` s, never from the first
    update (which compiles): "compiling" until that one is done, n/a until a second one."""

    def __init__(self, total: int, counts, interval: float = 5.0, window: float = 60.0, clock=time.time, start=True):
        self.total, self.counts, self.interval, self.span, self.clock = total, counts, interval, window, clock
        self.returns = deque(maxlen=20)
        self.window = deque([(clock(), *counts())], maxlen=7)
        self.updates = deque()  # (time, learned) at each update's end
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, name="progress", daemon=True)
        if start:
            self.thread.start()

    def updated(self, learned: int):
        """An update ended: `learned` env steps are learned from."""
        with self.lock:
            now = self.clock()
            self.updates.append((now, learned))
            while len(self.updates) > 2 and self.updates[1][0] < now - self.span:
                self.updates.popleft()

    def eta(self, now: float) -> str:
        with self.lock:
            updates = list(self.updates)
        if not updates:
            return "n/a (compiling the first update)"
        (t0, learned0), (t1, learned1) = updates[0], updates[-1]
        if t1 <= t0 or learned1 <= learned0:
            return "n/a"
        left = max((self.total - learned1) / ((learned1 - learned0) / (t1 - t0)) - (now - t1), 0.0)
        return f"{int(left // 3600)}:{int(left % 3600 // 60):02d}:{int(left % 60):02d}"

    def line(self) -> str:
        sampled, learned = self.counts()
        self.window.append((self.clock(), sampled, learned))
        (then, sampled_then, _), now = self.window[0], self.window[-1][0]
        sps = (sampled - sampled_then) / max(now - then, 1e-9)
        returns = list(self.returns)
        mean_ret = f"{np.mean(returns):.1f}" if returns else "n/a"
        return (f"step {sampled:>10d} sampled {learned:>10d} learned of {self.total}  SPS {sps:7.0f}  "
                f"return(last 20) {mean_ret}  ETA {self.eta(now)}")

    def run(self):
        while not self.done.wait(self.interval):
            print(self.line(), flush=True)

    def close(self):
        self.done.set()
        if self.thread.is_alive():
            self.thread.join()
