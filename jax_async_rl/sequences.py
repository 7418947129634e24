"""Sequence replay for recurrent agents (R2D2, Kapturowski et al. 2019; rlpyt's sequence buffers):
dqn_envpool.py --lstm.

The rows are `replay.Replay`'s, in the same per-env rings (frames stored once); a sequence is a
window of `length` consecutive rows of one env, starting at a row where the actor's recurrent
state was stored: every `period` rows of that env (rows 0, period, 2 period, ...), so windows
overlap when `period < length`. Only those states are kept, `[rows // period, num_envs, ...]`,
not one per row. A window runs on across episode ends: the learner resets the state where an
episode starts inside it, as the actor did, so the state stored at an episode's first row (which
the actor had reset) never carries the previous episode into it.

A sequence can be sampled (`live`, one slot per stored state) once its last row is written, and
until the ring overwrites its first row or a row that row's frame stack reaches back to. Uniform
replay draws live slots by rejection; prioritised replay samples the sum tree over the slots, each
sequence's priority being what the learner computes over its steps (R2D2: η max|δ| + (1 − η)
mean|δ|), a new sequence coming in at the largest so far.
"""

import jax
import numpy as np

from jax_async_rl.replay import Replay, SumTree


class SequenceReplay(Replay):
    """`Replay`'s rows read as sequences of `length` rows with the state stored at their first.

    `add(env_ids, obs, action, reward, terminated, truncated, elapsed, state)`: `Replay.add`'s rows
    with `state`, the recurrent state (a pytree of [N, ...]) the actor acted from on each row;
    only those of rows where sequences start are kept. `sample(batch_size, rng, beta, num_batches)`:
    [num_batches, batch_size, length, ...] windows of `obs`, `action`, `reward`, `terminated`,
    `truncated` (the rows as stored), `memory` (the state at each window's first row,
    [num_batches, batch_size, ...]), `slots` and `weights` (importance weights); priorities come
    back per sequence through `update_priorities`. `capacity` is rounded down to whole periods
    of every env's ring."""

    def __init__(
        self,
        capacity: int,
        num_envs: int,
        obs_example,
        action_example,
        state_example,
        length: int,
        period: int,
        frame_stack: int = 1,
        alpha: float = 0.0,
        eps: float = 1e-6,
    ):
        rows = capacity // num_envs // period * period
        if rows < length + period + frame_stack:
            raise ValueError(
                f"{rows} rows an env are too few for sequences of {length} every {period} rows"
            )
        super().__init__(
            rows * num_envs, num_envs, obs_example, action_example, frame_stack=frame_stack, eps=eps
        )
        self.length = length
        self.period = period
        self.starts = rows // period
        self.alpha = alpha
        self.state = jax.tree.map(
            lambda x: np.zeros((self.starts, num_envs, *np.shape(x)[1:]), np.asarray(x).dtype),
            state_example,
        )
        # the row each slot's sequence starts at
        self.begin = np.full((self.starts, num_envs), -1, np.int64)
        self.live = np.zeros(self.starts * num_envs, bool)  # slots whose sequence can be sampled
        self.tree = SumTree(self.starts * num_envs) if alpha else None

    @property
    def fill(self) -> float:
        """The fraction of the sequence slots that can be sampled."""
        return len(self) / len(self.live)

    def add(self, env_ids, obs, action, reward, terminated, truncated, elapsed, state):
        t, e = self.write(env_ids, obs, action, reward, terminated, truncated, elapsed)
        begins = t % self.period == 0
        j, e_begins = t[begins] // self.period % self.starts, e[begins]
        for store, value in zip(jax.tree.leaves(self.state), jax.tree.leaves(state), strict=True):
            store[j, e_begins] = np.asarray(value)[begins]
        self.begin[j, e_begins] = t[begins]
        # Complete (its last row written) and whole (its first row's stack not overwritten).
        was, renewed = self.live, np.zeros(len(self.live), bool)
        renewed[j * self.num_envs + e_begins] = True
        oldest = self.count - self.rows + self.stack - 1
        self.live = (
            (self.begin >= 0) & (self.begin >= oldest) & (self.begin + self.length <= self.count)
        ).ravel()
        if self.tree is not None:
            stale, fresh = (
                np.flatnonzero(was & ~self.live),
                np.flatnonzero(self.live & (~was | renewed)),
            )
            self.tree.update(
                np.concatenate([stale, fresh]),
                np.r_[np.zeros(len(stale)), np.full(len(fresh), self.max_priority**self.alpha)],
            )

    def row_of(self, slots):
        """(first row, env id) of the sequences in `slots`."""
        j, e = np.divmod(np.asarray(slots, np.int64), self.num_envs)
        return self.begin[j, e], e

    def gather(self, slots, beta: float):
        """The sequences in `slots`: windows [N, length, ...] of their rows and their stored
        states."""
        first, e = self.row_of(slots)
        t = (first[:, None] + np.arange(self.length)).ravel()
        e_rows = np.repeat(e, self.length)

        def windows(x):
            return x.reshape(len(slots), self.length, *x.shape[1:])

        rows = (t % self.rows, e_rows)
        j = first // self.period % self.starts
        return dict(
            obs=jax.tree.map(windows, self.stacked(t, e_rows)),
            action=windows(self.action[rows]),
            reward=windows(self.reward[rows]),
            terminated=windows(self.terminated[rows]),
            truncated=windows(self.truncated[rows]),
            memory=jax.tree.map(lambda store: store[j, e], self.state),
            slots=slots,
            weights=self.weights(slots, beta),
        )
