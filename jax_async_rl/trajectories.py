"""On-policy trajectory storage, the counterpart of replay.py for the PPO family: a rollout
(`Rollout`, time-major [T, B, ...] host arrays, `new_rollout`) and the rollouts an actor thread is
filling (`Trajectories`), written as envpool returns its envs, in any order. A data structure:
the scripts' actor loops decide what goes in and when; nothing here is algorithm."""

from typing import Any, NamedTuple

import jax
import numpy as np


class Rollout(NamedTuple):
    """One actor thread's rollout, as its queue hands it to the learner (Cleanba's and purejaxrl's
    NamedTuple): the arrays the learner uploads (`arrays`), time-major [T, B, ...] but for
    `bootstrap_obs` and `state` ([B, ...]), and two fields it reads on the host: `games`, those
    that ended in the rollout, and with --lstm `next_state`, the envs' states after it (a
    --deterministic checkpoint carries them for a resume)."""

    obs: Any  # a pytree, as envpool returns observations
    actions: np.ndarray
    logprobs: np.ndarray
    rewards: np.ndarray
    dones: np.ndarray
    truncated: np.ndarray
    valid: np.ndarray  # 0: a reset step (its action is ignored)
    policy_version: np.ndarray
    bootstrap_obs: Any  # the observation after the last row
    first: Any = None  # --lstm: where an episode starts
    state: Any = None  # --lstm: the states before row 0
    games: Any = ()  # (env, return, length) of each game that ended
    next_state: Any = None  # --lstm: the states after the last row
    outcomes: Any = ()  # --self-play: (opponent kind, place, reward) of each game that ended

    def arrays(self) -> dict:
        """What the learner uploads, by name (devices.joined and to_learner key rollouts' leaves
        by name): every field but `games`, `next_state`, `outcomes` and those left None."""
        fields = self._asdict()
        del fields["games"], fields["next_state"], fields["outcomes"]
        return {name: x for name, x in fields.items() if x is not None}


def write(tree, index, values, rows=...):
    """tree[index] = values[rows], leaf by leaf: observations are pytrees of host arrays."""
    for buffer, value in zip(jax.tree.leaves(tree), jax.tree.leaves(values), strict=True):
        buffer[index] = value[rows]


def new_rollout(T: int, B: int, obs, action_space, memory=None) -> Rollout:
    """Empty host buffers of one rollout; `obs`: a batch of observations; `memory`: with --lstm,
    the recurrent states of the B envs (the shapes of `state` and `next_state`)."""

    def zeros(dtype=np.float32):
        return np.zeros((T, B), dtype)

    return Rollout(
        obs=jax.tree.map(lambda x: np.zeros((T, B, *x.shape[1:]), x.dtype), obs),
        actions=np.zeros((T, B, *action_space.shape), action_space.dtype),
        logprobs=zeros(),
        rewards=zeros(),
        dones=zeros(),
        truncated=zeros(),
        valid=zeros(),
        policy_version=zeros(np.int32),
        bootstrap_obs=jax.tree.map(lambda x: np.zeros((B, *x.shape[1:]), x.dtype), obs),
        first=None if memory is None else zeros(),
        state=jax.tree.map(np.zeros_like, memory),
        next_state=jax.tree.map(np.zeros_like, memory),
    )


class Trajectories:
    """The rollouts an actor thread is filling, by number. Env e's n-th step of the run goes to
    rollout n // T, row n % T, column e, in any order envpool returns envs, from step `start` on (a
    resumed run's first rollout x T; `replayed`: its envs were stepped there, journal.replay, with
    `prev_dones` their dones, and the step before it in flight). A rollout is complete once every
    env has delivered the observation after its last row (`bootstrap_obs`; with --lstm also the
    state after it, `next_state`). The step after an episode's end only resets the env (its action
    is ignored): `valid` 0."""

    def __init__(
        self, T: int, B: int, action_space, memory=None, start=0, replayed=False, prev_dones=None
    ):
        self.T, self.B, self.start = T, B, start
        self.action_space, self.memory = action_space, memory
        self.steps = np.full(B, start, np.int64)  # each env's steps sent
        self.sent = np.full(B, replayed)  # whether one was
        self.prev_dones = np.zeros(B, bool) if prev_dones is None else prev_dones
        self.buffers = {}  # the rollouts being filled, by number
        self.bootstrapped = {}  # and how many of their envs delivered bootstrap_obs

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
        index = self.steps[env_ids]
        self.prev_dones[env_ids] = done  # a first observation's done is False
        # The envs a step of this run's rollouts returned, and that step's row.
        s = self.sent[env_ids] & (index > self.start)
        for _, buf, rows, ids, sel in self.at(index[s] - 1, env_ids[s], obs):
            buf.rewards[rows, ids] = reward[s][sel]
            buf.truncated[rows, ids] = truncated[s][sel]
            buf.dones[rows, ids] = done[s][sel]
        ends = s & (index % self.T == 0)
        if not ends.any():
            return
        for n, buf, _, ids, sel in self.at(index[ends] - self.T, env_ids[ends], obs):
            write(buf.bootstrap_obs, ids, jax.tree.map(lambda x: x[ends], obs), sel)
            if memory is not None:
                after = jax.tree.map(lambda x: x[env_ids[ends]], memory)
                write(buf.next_state, ids, after, sel)
            self.bootstrapped[n] = self.bootstrapped.get(n, 0) + len(ids)

    def started(self, env_ids, obs, version, core, turns=1.0) -> list:
        """The rows of the steps `obs` starts, chosen by policy `version` (with --lstm: `core`, the
        states before them and `first`); `turns`: 0 where the step is not the learner's move
        (--self-play's opponents'), `valid` 0 too. Returns those rows' rollouts, for `acted`."""
        index = self.steps[env_ids]
        current = self.at(index, env_ids, obs)
        valid = (1.0 - self.prev_dones[env_ids]) * turns
        for _, buf, rows, ids, sel in current:
            write(buf.obs, (rows, ids), obs, sel)
            buf.valid[rows, ids] = valid[sel]
            buf.policy_version[rows, ids] = version
            if core is not None:
                buf.first[rows, ids] = core[1][sel]
                before = jax.tree.map(lambda x: x[sel][rows == 0], core[0])
                write(buf.state, ids[rows == 0], before)
        return current

    def acted(self, current, env_ids, action, logprob):
        """The actions sent to `env_ids` (and their log-probabilities), into the rows `started`
        returned."""
        for _, buf, rows, ids, sel in current:
            buf.actions[rows, ids] = action[sel]
            buf.logprobs[rows, ids] = logprob[sel]
        self.steps[env_ids] += 1
        self.sent[env_ids] = True

    def complete(self):
        """The oldest rollout, removed, once it is complete; else None."""
        if not self.buffers or self.bootstrapped.get(min(self.buffers)) != self.B:
            return None
        del self.bootstrapped[min(self.buffers)]
        return self.buffers.pop(min(self.buffers))
