"""On-policy trajectory storage, the counterpart of replay.py for the PPO family: the host
buffers of a rollout (`new_rollout`, time-major [T, B, ...]) and the rollouts an actor thread is
filling (`Trajectories`), written as envpool returns its envs, in any order. A data structure:
the scripts' actor loops decide what goes in and when; nothing here is algorithm."""

import jax
import numpy as np


def write(tree, index, values, rows=...):
    """tree[index] = values[rows], leaf by leaf: observations are pytrees of host arrays."""
    for buffer, value in zip(jax.tree.leaves(tree), jax.tree.leaves(values), strict=True):
        buffer[index] = value[rows]


def new_rollout(T: int, B: int, obs, action_space, memory=None) -> dict:
    """Empty host buffers of one rollout, time-major [T, B, ...]; `obs`: a batch of observations;
    `memory`: with --lstm, the recurrent states of the B envs, recorded at row 0 ("state")."""
    fields = ["logprobs", "rewards", "dones", "truncated", "valid"] + ["first"] * (
        memory is not None
    )
    rollout = {name: np.zeros((T, B), np.float32) for name in fields}
    if memory is not None:
        rollout["state"] = jax.tree.map(np.zeros_like, memory)
    rollout["host"] = (
        {"next_state": jax.tree.map(np.zeros_like, memory)} if memory is not None else {}
    )
    rollout["actions"] = np.zeros((T, B, *action_space.shape), action_space.dtype)
    rollout["policy_version"] = np.zeros((T, B), np.int32)
    rollout["obs"] = jax.tree.map(lambda x: np.zeros((T, B, *x.shape[1:]), x.dtype), obs)
    rollout["bootstrap_obs"] = jax.tree.map(lambda x: np.zeros((B, *x.shape[1:]), x.dtype), obs)
    return rollout


class Trajectories:
    """The rollouts an actor thread is filling, by number. Env e's n-th step of the run goes to
    rollout n // T, row n % T, column e, in any order envpool returns envs, from step `start` on (a
    resumed run's first rollout x T; `replayed`: its envs were stepped there, journal.replay, with
    `prev_dones` their dones, and the step before it in flight). A rollout is complete once every
    env has delivered the observation after its last row (`bootstrap_obs`; with --lstm also the
    state after it, kept on the host for a resume: "host"). The step after an episode's end only
    resets the env (its action is ignored): `valid` 0."""

    def __init__(
        self, T: int, B: int, action_space, memory=None, start=0, replayed=False, prev_dones=None
    ):
        self.T, self.B, self.action_space, self.memory, self.start = (
            T,
            B,
            action_space,
            memory,
            start,
        )
        self.steps, self.sent = (
            np.full(B, start, np.int64),
            np.full(B, replayed),
        )  # steps sent; whether one was
        self.prev_dones = np.zeros(B, bool) if prev_dones is None else prev_dones
        self.buffers, self.bootstrapped = (
            {},
            {},
        )  # rollouts being filled, by number, and their bootstrap counts

    def at(self, index, env_ids, obs) -> list:
        """[(k, rollout k, rows, env ids, selection)] for the rollouts k = index // T that the env
        steps `index` of `env_ids` fall in: one rollout and no masks in the common case (no
        np.unique); a rollout not begun yet gets buffers that take the shapes of `obs`."""
        k = index // self.T
        if not len(k) or k.min() == k.max():
            ks, selections = k[:1].tolist(), [slice(None)]
        else:
            ks = np.unique(k).tolist()
            selections = [k == n for n in ks]
        for n in ks:
            if n not in self.buffers:
                self.buffers[n] = new_rollout(self.T, self.B, obs, self.action_space, self.memory)
        return [
            (n, self.buffers[n], index[sel] - n * self.T, env_ids[sel], sel)
            for n, sel in zip(ks, selections)
        ]

    def returned(self, env_ids, obs, reward, done, truncated, memory=None):
        """What recv() returned for `env_ids` of the step before observation number steps[env_ids]:
        its reward and dones, and the bootstrap_obs (and with `memory` the envs' states) of a
        rollout that step ends."""
        index, self.prev_dones[env_ids] = (
            self.steps[env_ids],
            done,
        )  # a first observation's done is False
        s = self.sent[env_ids] & (
            index > self.start
        )  # the envs a step of this run's rollouts returned
        for _, buf, rows, ids, sel in self.at(index[s] - 1, env_ids[s], obs):  # that step's row
            buf["rewards"][rows, ids], buf["truncated"][rows, ids], buf["dones"][rows, ids] = (
                reward[s][sel],
                truncated[s][sel],
                done[s][sel],
            )
        ends = s & (index % self.T == 0)
        for n, buf, _, ids, sel in (
            self.at(index[ends] - self.T, env_ids[ends], obs) if ends.any() else []
        ):
            write(buf["bootstrap_obs"], ids, jax.tree.map(lambda x: x[ends], obs), sel)
            if memory is not None:
                write(
                    buf["host"]["next_state"],
                    ids,
                    jax.tree.map(lambda x: x[env_ids[ends]], memory),
                    sel,
                )
            self.bootstrapped[n] = self.bootstrapped.get(n, 0) + len(ids)

    def started(self, env_ids, obs, version, core) -> list:
        """The rows of the steps `obs` starts, chosen by policy `version` (with --lstm: `core`, the
        states before them and `first`). Returns those rows' rollouts, for `acted`."""
        index = self.steps[env_ids]
        current = self.at(index, env_ids, obs)
        valid = 1.0 - self.prev_dones[env_ids]
        for _, buf, rows, ids, sel in current:
            write(buf["obs"], (rows, ids), obs, sel)
            buf["valid"][rows, ids], buf["policy_version"][rows, ids] = valid[sel], version
            if core is not None:
                buf["first"][rows, ids] = core[1][sel]
                write(
                    buf["state"], ids[rows == 0], jax.tree.map(lambda x: x[sel][rows == 0], core[0])
                )
        return current

    def acted(self, current, env_ids, action, logprob):
        """The actions sent to `env_ids` (and their log-probabilities), into the rows `started`
        returned."""
        for _, buf, rows, ids, sel in current:
            buf["actions"][rows, ids], buf["logprobs"][rows, ids] = action[sel], logprob[sel]
        self.steps[env_ids] += 1
        self.sent[env_ids] = True

    def complete(self):
        """The oldest rollout, removed, once it is complete; else None."""
        if not self.buffers or self.bootstrapped.get(min(self.buffers)) != self.B:
            return None
        del self.bootstrapped[min(self.buffers)]
        return self.buffers.pop(min(self.buffers))
