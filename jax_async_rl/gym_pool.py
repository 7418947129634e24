"""Your own Gymnasium environments behind envpool's interface (`GymPool`), so that every
script's actor, collector, evaluation and video code runs them unchanged: `async_reset`,
`recv` / `send` with env ids and a batch of one split, `step`, `reset`, the spaces, and
`info["env_id"]` / `info["elapsed_step"]`.

Each split (`batch_size` envs) lives in worker processes of its own (several envs to a process),
so that while the actor runs inference for one split the other's envs step (double buffering,
as with envpool). A worker is a fresh interpreter that imports this module and the env's, not
the training script nor JAX.
Autoreset follows envpool's rule: the step after an episode's end returns the first
observation of the next, with reward 0, and its action is ignored. An env that raises in a
worker, a worker that dies, or an env that does not answer within `timeout` seconds (a hung
env: --env-timeout) raises `EnvError` here naming the env (and with its traceback).

No process outlives its run. A pool's workers, and any process an env starts (a simulator), are
in one process group, led by a small guard process that kills the group when the run's process
ends, however it ends (the kernel closes the guard's pipe from the run); `close` kills the group
too, a worker stuck in `step` included. Each worker is also tied to the run by the kernel
(`PR_SET_PDEATHSIG`) where the main thread made the pool.

`--env-id module:callable` (a `gymnasium.Env` subclass or a function that returns one) or
`--env-id ID --env-module MODULE` (an id that importing MODULE registers with Gymnasium), with
`--env-kwargs JSON`, makes such a pool (`tasks.user_maker` checks them; `make_user_env` makes
one, in any process).
"""

import ctypes
import importlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait

import gymnasium
import numpy as np


class Stopped(Exception):
    """A blocking call gave up because the run stops (a user env's `recv`): not an error, the
    thread just ends."""


class EnvError(RuntimeError):
    """An env raised in its worker, hung, returned what it cannot, or its worker died: `line`, one
    line naming the env by its index (the run adds its --env-id), and `details`, its traceback."""

    def __init__(self, line: str, details: str = ""):
        super().__init__(f"{line}\n{details}" if details else line)
        self.line, self.details = line, details


def stack(items: list):
    """Per-env observations (arrays or dicts of arrays) -> one batch of the same structure."""
    if isinstance(items[0], dict):
        return {key: stack([item[key] for item in items]) for key in items[0]}
    return np.stack([np.asarray(item) for item in items])


def leaves(obs, path: str = "") -> list:
    """(path, array) of each leaf of an observation (or a batch), `[key]` into Dicts."""
    if isinstance(obs, dict):
        return [leaf for key in obs for leaf in leaves(obs[key], f"{path}[{key!r}]")]
    return [(path, np.asarray(obs))]


def fault(obs: list, first: list, env_ids, elapsed):
    """(env id, what it returned) of the first env whose observation differs in its leaves, shape
    or dtype from `first` ((path, shape, dtype) of the worker's first), or holds a NaN or an inf."""
    for k, o in enumerate(obs):
        if [path for path, _ in leaves(o)] != [path for path, _, _ in first]:
            return env_ids[k], (
                f"returned an observation of keys {[p for p, _ in leaves(o)]} where its first had "
                f"{[p for p, _, _ in first]}"
            )
        when = f"at step {elapsed[k]} of its episode"
        for (path, x), (_, shape, dtype) in zip(leaves(o), first):
            if (x.shape, x.dtype) != (shape, dtype):
                return env_ids[k], (
                    f"returned an observation{path} of shape {x.shape} {x.dtype} {when}, where "
                    f"its first "
                    f"had {shape} {dtype}"
                )
            if x.dtype.kind == "f" and not np.isfinite(x).all():
                return env_ids[
                    k
                ], f"returned a non-finite observation{path} ({x[~np.isfinite(x)][0]}) {when}"
    return None


# The guard of a pool's process group (`python -S -c GUARD`, a few MB): its stdin is a pipe from the
# run's process, which the kernel closes when that process ends, however it ends.
GUARD = (
    "import os, signal\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))\n"
    "while os.read(0, 1):\n    pass\n"
    "os.killpg(0, signal.SIGKILL)\n"
)
# A worker's interpreter: the run's sys.path first (to unpickle `make`), then this module alone.
WORKER = (
    "import sys\n"
    "from multiprocessing.connection import Connection\n"
    "conn = Connection(int(sys.argv[1]))\n"
    "sys.path[:] = conn.recv()\n"
    "from jax_async_rl.gym_pool import serve\n"
    "serve(conn, int(sys.argv[2]), sys.argv[3] == '1')\n"
)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def serve(conn, parent: int, tie: bool):
    """A worker's life: tied to the run's process by the kernel (`tie`), then `worker`."""
    if tie:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # not Linux: the guard alone
            pass
    if os.getppid() != parent:  # the run ended before the tie held
        return
    for signum in (signal.SIGINT, signal.SIGTERM):  # the run stops its workers itself
        signal.signal(signum, signal.SIG_IGN)
    try:
        make, env_ids, seed = conn.recv()
    except EOFError:
        return
    worker(conn, make, env_ids, seed)


def worker(conn, make, env_ids: list, seed: int):
    """A split's process: its envs, stepped in turn; replies (obs, reward, terminated, truncated,
    elapsed) for the split, or ("error", env id, traceback)."""
    current = env_ids[0]
    try:
        envs = []
        for i in env_ids:
            current = i
            envs.append(make())
        elapsed = np.zeros(len(envs), np.int32)
        done, first = np.zeros(len(envs), bool), None
        while True:
            command, actions = conn.recv()
            if command == "close":
                return
            if command == "render":
                conn.send(envs[0].render())
                continue
            obs, rewards = [], np.zeros(len(envs), np.float32)
            terminated, truncated = np.zeros(len(envs), bool), np.zeros(len(envs), bool)
            for k, env in enumerate(envs):
                current = env_ids[k]
                if command == "reset" or done[k]:
                    o, _ = env.reset(seed=seed + env_ids[k] if command == "reset" else None)
                    elapsed[k], done[k] = 0, False
                else:
                    o, rewards[k], terminated[k], truncated[k], _ = env.step(actions[k])
                    elapsed[k] += 1
                    done[k] = terminated[k] or truncated[k]
                obs.append(o)
            # What the network cannot take is named here, once per reply on the batch (the failure
            # path alone looks at each env): a shape or dtype that changed, a NaN or an inf.
            first = first or [(path, x.shape, x.dtype) for path, x in leaves(obs[0])]
            try:
                batch = stack(obs)
            except ValueError:
                batch = None
            if (
                batch is None
                or [(p, x.shape[1:], x.dtype) for p, x in leaves(batch)] != first
                or not all(np.isfinite(x).all() for _, x in leaves(batch) if x.dtype.kind == "f")
            ):
                bad = fault(obs, first, env_ids, elapsed)
                if bad is not None:
                    conn.send(("fault", *bad))
                    continue
            conn.send(
                (
                    stack(obs) if batch is None else batch,
                    rewards,
                    terminated,
                    truncated,
                    elapsed.copy(),
                )
            )
    except (EOFError, KeyboardInterrupt):
        return
    except BaseException:
        conn.send(("error", current, traceback.format_exc()))


class GymPool:
    """`num_envs` envs made by `make()` (a picklable callable), in splits of `batch_size`, each
    split's envs shared out over processes of its own: `processes` in all (at least one a split,
    at most one an env); `timeout`: the seconds an env may take to answer (--env-timeout); `stop`:
    the run's stop event, on which a wait gives up (Stopped); see the module docstring."""

    def __init__(
        self,
        make,
        num_envs: int,
        batch_size: int,
        seed: int,
        processes: int = 1,
        timeout: float = 300.0,
        stop=None,
    ):
        if num_envs % batch_size:
            raise ValueError(f"{num_envs} envs do not split into batches of {batch_size}")
        probe = make()
        self.observation_space, self.action_space = probe.observation_space, probe.action_space
        self.metadata = dict(getattr(probe, "metadata", {}) or {})
        probe.close()
        self.num_envs, self.batch_size, self.splits = num_envs, batch_size, num_envs // batch_size
        # One process steps its envs in turn: an env that waits (a simulator, a sleep) overlaps
        # with others only in processes of their own, while an env that computes gains nothing
        # from more processes than cores (--num-threads: the cores, by default).
        self.workers = max(1, min(batch_size, processes // self.splits))
        # Worker w of a split holds its envs [cuts[w], cuts[w + 1]).
        self.cuts = [batch_size * w // self.workers for w in range(self.workers + 1)]
        self.timeout = timeout
        self.stop = stop
        self.asked = {}
        self.closed = False
        self.conns = []
        self.procs = []
        self.sentinels = []
        self.pending = []
        self.replies = {}
        self.guard = subprocess.Popen(
            [sys.executable, "-S", "-c", GUARD], stdin=subprocess.PIPE, process_group=0
        )
        # the kernel ties to a thread
        tie = "1" if threading.current_thread() is threading.main_thread() else "0"
        for first in range(0, num_envs, batch_size):
            for w in range(self.workers):
                ids = list(range(first + self.cuts[w], first + self.cuts[w + 1]))
                self.start(make, ids, seed, tie)

    def start(self, make, env_ids: list, seed: int, tie: str):
        """A worker of `env_ids`, in the guard's process group: a fresh interpreter (no fork of a
        process that runs JAX's threads), which takes `make` over its socket."""
        parent, child = socket.socketpair()
        with child:
            proc = subprocess.Popen(
                [sys.executable, "-c", WORKER, str(child.fileno()), str(os.getpid()), tie],
                pass_fds=[child.fileno()],
                stdin=subprocess.DEVNULL,
                process_group=self.guard.pid,
            )
        conn = Connection(parent.detach())
        conn.send(sys.path)
        conn.send((make, env_ids, seed))
        self.conns.append(conn)
        self.procs.append(proc)
        # readable once it ends
        self.sentinels.append(os.pidfd_open(proc.pid) if hasattr(os, "pidfd_open") else None)

    def split_of(self, env_ids) -> int:
        return int(env_ids[0]) // self.batch_size

    def of_split(self, split: int) -> range:
        """The indices (in conns and procs) of a split's workers."""
        return range(split * self.workers, (split + 1) * self.workers)

    def async_reset(self):
        for split in range(self.splits):
            for i in self.of_split(split):
                self.conns[i].send(("reset", None))
            self.pending.append(split)
            self.asked[split] = ("reset", time.monotonic())

    def send(self, actions, env_ids=None):
        split = 0 if env_ids is None else self.split_of(env_ids)
        actions = np.asarray(actions)
        for w, i in enumerate(self.of_split(split)):
            try:
                self.conns[i].send(("step", actions[self.cuts[w] : self.cuts[w + 1]]))
            except (BrokenPipeError, ConnectionError):
                pass  # its worker is gone: recv says so
        self.pending.append(split)
        self.asked[split] = ("step", time.monotonic())

    def recv(self, timeout=None):
        """The first split whose step finished (in all of its workers): (obs, reward, terminated,
        truncated, info). EnvError once an env has not answered for `self.timeout` s; with
        `timeout`, TimeoutError once that many seconds pass first (the splits stay pending: a
        caller that checks for a stop between waits calls again); Stopped once the run's
        stop is set (a hung env does not hold up a signal)."""
        if not self.pending:
            raise RuntimeError("recv without a pending reset or step")
        give_up = None if timeout is None else time.monotonic() + timeout
        while True:
            for split in self.pending:
                if all(i in self.replies for i in self.of_split(split)):
                    self.pending.remove(split)
                    return self.result(split, [self.replies.pop(i) for i in self.of_split(split)])
            waiting = [
                i for split in self.pending for i in self.of_split(split) if i not in self.replies
            ]
            call, since = min(
                (self.asked[split] for split in self.pending), key=lambda asked: asked[1]
            )
            now, overdue = time.monotonic(), since + self.timeout
            if now >= overdue:
                late = [i for i in waiting if self.asked[i // self.workers][1] == since]
                raise EnvError(
                    f"{self.envs_of(late[0])} did not answer {call}() within --env-timeout "
                    f"{self.timeout:g} s: a hung env (raise --env-timeout if it is only slow)"
                )
            if give_up is not None and now >= give_up:
                raise TimeoutError(f"no split answered within {timeout} s")
            if self.stop is not None and self.stop.is_set():
                raise Stopped("the run stops")
            watched = [self.conns[i] for i in waiting] + [
                self.sentinels[i] for i in waiting if self.sentinels[i] is not None
            ]
            ready = wait(
                watched,
                timeout=min(overdue, give_up or overdue, now + (0.2 if self.stop else 1e9)) - now,
            )
            for i in waiting:
                if self.conns[i] in ready or self.sentinels[i] in ready:
                    self.replies[i] = self.reply(i)

    def envs_of(self, i: int) -> str:
        """Worker i's envs, in words."""
        split, w = divmod(i, self.workers)
        first, last = (
            split * self.batch_size + self.cuts[w],
            split * self.batch_size + self.cuts[w + 1] - 1,
        )
        return f"envs {first}-{last}" if last > first else f"env {first}"

    def reply(self, i: int):
        try:
            reply = self.conns[i].recv()
        except (EOFError, ConnectionError):
            try:
                self.procs[i].wait(1)
            except subprocess.TimeoutExpired:
                pass
            raise EnvError(
                f"the worker of {self.envs_of(i)} died (exit code {self.procs[i].returncode})"
            )
        if isinstance(reply, tuple) and len(reply) == 3 and reply[0] == "error":
            raise EnvError(f"env {reply[1]} raised in its worker (its traceback above)", reply[2])
        if isinstance(reply, tuple) and len(reply) == 3 and reply[0] == "fault":
            raise EnvError(f"env {reply[1]} {reply[2]}")
        return reply

    def result(self, split: int, replies: list):
        obs, rewards, terminated, truncated, elapsed = (
            concat([r[k] for r in replies]) for k in range(5)
        )
        env_ids = np.arange(split * self.batch_size, (split + 1) * self.batch_size, dtype=np.int32)
        return obs, rewards, terminated, truncated, {"env_id": env_ids, "elapsed_step": elapsed}

    def reset(self):
        self.async_reset()
        return self.gather()[0], {}

    def step(self, actions, env_ids=None):
        """All splits at once (a pool of one split: `recv` after `send`)."""
        actions = np.asarray(actions)
        for split in range(self.splits):
            self.send(
                actions[split * self.batch_size : (split + 1) * self.batch_size],
                np.arange(split * self.batch_size, (split + 1) * self.batch_size),
            )
        return self.gather()

    def gather(self):
        results = sorted(
            (self.recv() for _ in range(self.splits)), key=lambda r: int(r[4]["env_id"][0])
        )
        obs = concat([r[0] for r in results])
        info = {
            key: np.concatenate([r[4][key] for r in results]) for key in ("env_id", "elapsed_step")
        }
        return obs, *(np.concatenate([r[k] for r in results]) for k in (1, 2, 3)), info

    def close(self):
        """Every worker told first, then all given one 2 s deadline to close their envs; then the
        process group is killed: a worker stuck in a step, what the envs started, the guard."""
        if self.closed:
            return
        self.closed = True
        for conn in self.conns:
            try:
                conn.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 2.0
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.guard.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is empty already
            pass
        for proc in [*self.procs, self.guard]:
            proc.wait()
        self.guard.stdin.close()
        for resource in [*self.conns, *(fd for fd in self.sentinels if fd is not None)]:
            resource.close() if isinstance(resource, Connection) else os.close(resource)

    def render(self):
        """Env 0's frame (evaluation's video), as envpool's render gives it: [1, H, W, 3]."""
        self.conns[0].send(("render", None))
        if not self.conns[0].poll(self.timeout):
            raise EnvError(f"env 0 did not answer render() within --env-timeout {self.timeout:g} s")
        return np.asarray(self.conns[0].recv())[None]


def concat(batches: list):
    if isinstance(batches[0], dict):
        return {key: concat([b[key] for b in batches]) for key in batches[0]}
    return np.concatenate(batches)


def make_user_env(env_id: str, env_module, kwargs: dict, **extra):
    """A user's env (in any process: the worker imports the module itself)."""
    if env_module:
        importlib.import_module(env_module)
        return gymnasium.make(env_id, **kwargs, **extra)
    module, name = env_id.split(":", 1)
    return getattr(importlib.import_module(module), name)(**kwargs, **extra)
