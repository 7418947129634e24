"""What a --deterministic on-policy run needs to resume exactly where it stopped: the actions of
every update it learned from (`Journal`, a file in the run folder) and the replay that steps the
resumed run's envs, seeded as the run's were, through them (`replay`). envpool's envs are
deterministic from their seeds and actions, but their state is not saved with a checkpoint; the
actor's own state (its normaliser, game scores, which envs start an episode) comes back with
them, because the replay does per observation what the actor does, without its policy.
"""

import hashlib
import os
import sys

import jax
import numpy as np

from jax_async_rl import checkpoints
from jax_async_rl.checkpoints import JOURNAL
from jax_async_rl.flags import UsageError
from jax_async_rl.tasks import env_action


class Journal:
    """The actions [T, B, ...] of each update, appended in order to `run_dir`/actions.bin (process
    0's envs: every actor thread's, side by side), flushed to disk with each checkpoint, which
    records its sha256 up to the checkpoint's update (`digest`) so that a resume replays only the
    actions the run took. Opened never through a link, and only as a regular file of the run's
    own."""

    def __init__(self, run_dir: str, example):
        self.path, self.example = os.path.join(run_dir, JOURNAL), np.asarray(example)
        # an update's actions, as the checkpoint's record keeps it
        self.shape = str(list(self.example.shape))
        self.file = None
        self.hash, self.count = hashlib.sha256(), 0  # of the updates read and appended so far

    def read(self, updates: int, record=None, action_space=None, cut: bool = True):
        """The first `updates` updates' actions [updates, T, B, ...], checked: UsageError, one line
        saying what to do, if the journal is missing, a link, not a regular file, shorter, not the
        one the checkpoint's `record` (`digest`'s) describes, or holds an action outside
        `action_space`. With `cut`, the file is cut back to them (a run killed after its last
        checkpoint wrote more)."""
        size = updates * self.example.nbytes
        try:
            with checkpoints.open_own(
                self.path, os.O_RDWR if cut else os.O_RDONLY, "r+b" if cut else "rb"
            ) as f:
                data = f.read(size)
                if len(data) == size and (record is None or matches(data, record)) and cut:
                    f.truncate(size)
        except FileNotFoundError:
            raise refused(f"{self.path} is missing")
        except OSError as e:
            raise refused(f"{self.path} is not a regular file of the run's own ({e.strerror})")
        kept = record and record.get("shape", self.shape)  # before shapes were kept: the size only
        if record is not None and (record.get("bytes") != size or kept != self.shape):
            raise refused(
                f"{self.path} was kept with other --num-envs or --num-steps than these "
                f"(actions of shape {kept} an update, {record.get('bytes')} bytes to the "
                f"checkpoint; "
                f"these flags make {self.shape}, {size} bytes)"
            )
        if len(data) < size:
            raise refused(
                f"{self.path} holds fewer than the checkpoint's {updates} updates of actions"
            )
        if record is not None and not matches(data, record):
            raise refused(
                f"{self.path} is not the journal of the actions the run took (its sha256 differs "
                f"from the "
                "checkpoint's)"
            )
        actions = np.frombuffer(data, self.example.dtype).reshape(updates, *self.example.shape)
        if action_space is not None:
            check_actions(actions, action_space, self.path)
        self.hash, self.count = hashlib.sha256(data), updates
        return actions

    def moved(self, run_dir: str, actions):
        """A resume into another --run-dir: the journal goes on there, from a copy of the actions
        that `read` checked ([updates, T, B, ...], or None), and the resumed folder's is left as it
        is."""
        self.path = os.path.join(run_dir, JOURNAL)
        self.file = checkpoints.open_own(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "wb")
        if actions is not None:
            self.file.write(np.ascontiguousarray(actions, self.example.dtype).tobytes())

    def append(self, actions):
        # a new run's journal starts empty; a resumed one goes on after read's
        if self.file is None:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | (0 if self.count else os.O_TRUNC)
            self.file = checkpoints.open_own(self.path, flags, "ab")
        data = np.ascontiguousarray(actions, self.example.dtype).tobytes()
        self.file.write(data)
        self.hash.update(data)
        self.count += 1

    def digest(self, updates: int) -> dict:
        """The record of the first `updates` updates that a checkpoint keeps: their sha256, size
        and shape."""
        size, digest = updates * self.example.nbytes, self.hash
        if updates != self.count:
            with checkpoints.open_own(
                self.path, os.O_RDONLY, "rb"
            ) as f:  # more appended than learned from
                digest = hashlib.sha256(f.read(size))
        return {"sha256": digest.hexdigest(), "bytes": size, "shape": self.shape}

    def sync(self):
        """Flush and fsync (as a checkpoint is written: the journal never lags behind it)."""
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())

    def close(self):
        if self.file is not None:
            self.file.close()
            self.file = None


def matches(data: bytes, record: dict) -> bool:
    return hashlib.sha256(data).hexdigest() == record.get("sha256")


def refused(problem: str) -> UsageError:
    return UsageError(
        f"--resume --deterministic: {problem}, so the run cannot be replayed to where it stopped; "
        "resume with --no-deterministic (it goes on from its checkpoint, not as the uninterrupted "
        "run)"
    )


def check_actions(actions, action_space, path: str):
    """UsageError if an action of the journal is outside `action_space` (a policy_space): discrete
    ones in [0, n), multi-discrete ones in [0, nvec) a dimension, continuous ones finite."""
    if hasattr(action_space, "n"):
        bad = (actions < 0) | (actions >= int(action_space.n))
    elif hasattr(action_space, "nvec"):
        bad = (actions < 0) | (actions >= np.asarray(action_space.nvec))
    else:
        bad = ~np.isfinite(actions)
    if bad.any():
        update = int(np.argwhere(bad)[0][0])
        raise refused(f"{path} holds an action outside {action_space} (update {update})")


def check_carry(payload: dict, path: str):
    """UsageError, one line naming the checkpoint, where what it carries for a --deterministic
    resume (Keeper.carry's) is not what a run writes: parameters by version shaped as the state's,
    a journal record of a sha256 and a size, recurrent states by actor thread."""
    carry, params = payload.get("carry"), payload["state"].get("params")
    if carry is None:
        return

    def shapes(tree):
        return jax.tree.structure(tree), [np.shape(x) for x in jax.tree.leaves(tree)]

    parts = carry if isinstance(carry, dict) else {}
    acting, record, memory = parts.get("acting", {}), parts.get("journal"), parts.get("memory", {})
    fits = {
        "acting": isinstance(acting, dict)
        and all(str(v).isdigit() and shapes(tree) == shapes(params) for v, tree in acting.items()),
        "journal": record is None
        or isinstance(record, dict)
        and isinstance(record.get("sha256"), str)
        and np.asarray(record.get("bytes")).dtype.kind in "iu"
        and isinstance(record.get("shape", ""), str),
        "memory": isinstance(memory, dict) and all(isinstance(m, dict) for m in memory.values()),
    }
    wrong = (
        [name for name, good in fits.items() if not good] if isinstance(carry, dict) else ["carry"]
    )
    if wrong:
        raise UsageError(
            f"--resume: {path} carries a {wrong[0]!r} for --deterministic that no run writes; "
            f"resume "
            "from the run's own checkpoint, or with --no-deterministic"
        )


def verify(run_dir: str, carried, updates: int, shape, dtype, action_space):
    """A --deterministic resume's check at start-up, before anything is written: the journal that
    Keeper will replay, read as it will read it (not cut) and checked (Journal.read's UsageError).
    A checkpoint from before journals were recorded (no record in `carried`): a note that the
    journal cannot be verified, and its actions are checked against the action space only."""
    record = carried.get("journal") if isinstance(carried, dict) else None
    if not isinstance(record, dict):
        print(
            f"note: the checkpoint records no digest of {os.path.join(run_dir, JOURNAL)} (it was "
            f"written before "
            "checkpoints kept one): its actions are checked against the action space only",
            file=sys.stderr,
        )
        record = None
    Journal(run_dir, np.zeros(shape, dtype)).read(updates, record, action_space, cut=False)


def replay(envs, actions, normalizer, stats, env_offset: int, receive_last: bool):
    """Step `envs` (just made, seeded as the run's) through `actions` [steps, B, ...] (column e:
    env e's): each observation normalised (`normalizer.observe`), the game scores kept (`stats`),
    each step's reward added to the return statistics (`normalizer.reward`, env e as
    `env_offset` + e), as the actor does it; recv() in the envs' own order (a SplitPools's turns).
    The normaliser starts afresh and ends as the actor's was there. Returns each env's done of its
    last step [B]; with `receive_last` the observations after it
    too (the synchronous loop's), else (None: they are in flight, for the actor's first recv).
    The games in progress stay in `stats`; those that ended are dropped (the run logged them)."""
    steps, B = actions.shape[:2]
    sent, dones, last = np.zeros(B, np.int64), np.zeros(B, bool), None
    normalizer.reset()  # a checkpoint's statistics may count steps past it: rebuilt from the first
    envs.async_reset()
    while sent.min() < steps or (receive_last and last is None):
        obs, reward, terminated, truncated, info = envs.recv()
        env_ids = info["env_id"]
        reward = np.where(info["elapsed_step"] > 0, reward, 0.0)
        obs = normalizer.observe(obs)
        stats.update(env_ids, reward, terminated, truncated, info)
        ended, done = sent[env_ids] > 0, terminated | truncated
        normalizer.reward(reward[ended], done[ended], env_ids[ended] + env_offset)
        dones[env_ids[ended]] = done[ended]
        if sent[env_ids].min() == steps:  # receive_last: the observations after the last step
            last = obs
            continue
        envs.send(env_action(actions[sent[env_ids], env_ids], envs.action_space), env_ids)
        sent[env_ids] += 1
    stats.pop()  # the games that ended: the run logged them
    return dones, last


class Keeper:
    """What a --deterministic on-policy run keeps so that a resume goes on exactly as the run would
    have (one process; runs.Run makes it): the journal of its actions, and for its checkpoint the
    actor threads' recurrent states after the last update's rollouts and the parameters that its
    schedule still acts with (--actor-lag versions before the newest). `resumption(thread)` hands
    a resumed actor thread what it needs (actor_loop's `resume`)."""

    def __init__(
        self, run_dir, carried, updates: int, shape, dtype, threads: int, placed, space, source=None
    ):
        self.carried, self.threads = carried or {}, threads
        # `source`: a resume's other folder
        self.journal = Journal(source or run_dir, np.zeros(shape, dtype))
        self.placed = placed  # the carried parameters placed as the learner's are (runs.Run's mesh)
        # checked at start-up (verify); again here, as it is cut
        record = self.carried.get("journal")
        record = record if isinstance(record, dict) else None
        actions = self.journal.read(updates, record, space, cut=source is None) if updates else None
        if source is not None:
            self.journal.moved(run_dir, actions)
        # [steps, B, ...]
        self.actions = None if actions is None else actions.reshape(-1, *shape[1:])
        # What a checkpoint carries until the first update: what the resume carried.
        self.published = self.acting()
        self.memories = (
            [self.resumption(i)["memory"] for i in range(threads)]
            if "memory" in self.carried
            else None
        )

    def resumption(self, thread: int):
        if self.actions is None:
            return None
        B = self.actions.shape[1] // self.threads
        out = {"actions": self.actions[:, thread * B : (thread + 1) * B]}
        if self.carried.get("memory") is not None:  # the leaves of the thread's recurrent state
            leaves = self.carried["memory"][str(thread)]
            out["memory"] = [
                np.array(leaves[str(j)]) for j in range(len(leaves))
            ]  # writable: the actor updates it
        return out

    def acting(self) -> dict:
        """The carried parameters by version (int), for the actors' Shared."""
        return {int(v): self.placed(params) for v, params in self.carried.get("acting", {}).items()}

    def kept(self, actions, memories, published):
        """Before an update: its rollouts' `actions` [T, B, ...] (every actor thread's) into the
        journal; the threads' states after them (`memories`, --lstm) and `published` (the
        parameters by version) for the checkpoint."""
        self.journal.append(actions)
        self.memories, self.published = memories, published

    def carry(self, version: int, actor_lag: int) -> dict:
        """What the checkpoint of `version` carries; the journal synced to disk."""
        self.journal.sync()
        carry = {
            "acting": {
                str(v): self.published[v]
                for v in range(version - actor_lag, version)
                if self.published and v in self.published
            },
            "journal": self.journal.digest(version),
        }
        if self.memories and self.memories[0] is not None:
            carry["memory"] = {
                str(i): {str(j): x for j, x in enumerate(jax.tree.leaves(m))}
                for i, m in enumerate(self.memories)
            }
        return carry


def start_envs(envs, resume, normalizer, stats, memory, env_offset: int):
    """An actor's envs reset, or with `resume` (--deterministic) stepped back to where the run
    stopped (`replay`): (their dones then, or None; the recurrent states to go on from)."""
    if resume is None:
        envs.async_reset()
        return None, memory
    dones, _ = replay(envs, resume["actions"], normalizer, stats, env_offset, receive_last=False)
    return dones, jax.tree.unflatten(
        jax.tree.structure(memory), resume["memory"]
    ) if "memory" in resume else memory
