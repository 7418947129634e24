"""What a --deterministic on-policy run needs to resume exactly where it stopped: the actions of
every update it learned from (`Journal`, a file in the run folder) and the replay that steps the
resumed run's envs, seeded as the run's were, through them (`replay`). envpool's envs are
deterministic from their seeds and actions, but their state is not saved with a checkpoint; the
actor's own state (its normaliser, game scores, which envs start an episode) comes back with
them, because the replay does per observation what the actor does, without its policy.
"""

import os

import jax
import numpy as np

from jax_async_rl.tasks import env_action

JOURNAL = "actions.bin"


class Journal:
    """The actions [T, B, ...] of each update, appended in order to `run_dir`/actions.bin (process
    0's envs: every actor thread's, side by side), flushed to disk with each checkpoint."""

    def __init__(self, run_dir: str, example):
        self.path, self.example = os.path.join(run_dir, JOURNAL), np.asarray(example)
        self.file = None

    def read(self, updates: int):
        """The first `updates` updates' actions [updates, T, B, ...]; the file cut back to them
        (a run killed after its last checkpoint wrote more). OSError if fewer were written."""
        size = self.example.nbytes
        if not os.path.exists(self.path) or os.path.getsize(self.path) < updates * size:
            raise OSError(f"{self.path} holds fewer than the checkpoint's {updates} updates of actions")
        with open(self.path, "r+b") as f:
            f.truncate(updates * size)
            data = np.frombuffer(f.read(), self.example.dtype)
        return data.reshape(updates, *self.example.shape)

    def append(self, actions):
        if self.file is None:
            self.file = open(self.path, "ab")
        self.file.write(np.ascontiguousarray(actions, self.example.dtype).tobytes())

    def sync(self):
        """Flush and fsync (as a checkpoint is written: the journal never lags behind it)."""
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())

    def close(self):
        if self.file is not None:
            self.file.close()
            self.file = None


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

    def __init__(self, run_dir, carried, updates: int, shape, dtype, threads: int, placed):
        self.journal, self.carried, self.threads = Journal(run_dir, np.zeros(shape, dtype)), carried or {}, threads
        self.placed = placed  # the carried parameters placed as the learner's are (runs.Run's mesh)
        self.actions = self.journal.read(updates).reshape(-1, *shape[1:]) if updates else None  # [steps, B, ...]
        # What a checkpoint carries until the first update: what the resume carried.
        self.published = self.acting()
        self.memories = [self.resumption(i)["memory"] for i in range(threads)] if "memory" in self.carried else None

    def resumption(self, thread: int):
        if self.actions is None:
            return None
        B = self.actions.shape[1] // self.threads
        out = {"actions": self.actions[:, thread * B:(thread + 1) * B]}
        if self.carried.get("memory") is not None:  # the leaves of the thread's recurrent state
            leaves = self.carried["memory"][str(thread)]
            out["memory"] = [np.array(leaves[str(j)]) for j in range(len(leaves))]  # writable: the actor updates it
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
                for v in range(version - actor_lag, version) if self.published and v in self.published
            }
        }
        if self.memories and self.memories[0] is not None:
            carry["memory"] = {
                str(i): {
                    str(j): x
                    for j, x in enumerate(jax.tree.leaves(m))
                }
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
    return dones, jax.tree.unflatten(jax.tree.structure(memory), resume["memory"]) if "memory" in resume else memory
