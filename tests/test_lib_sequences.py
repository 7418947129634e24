"""Sequence replay (jax_async_rl/sequences.py) and the replay rounds' recurrent collection
(dqn_envpool.py's `collect` into a replay.Collecting), against a plain buffer of whole sequences:
every sequence that can be sampled, and nothing else, is exactly the rows the envs returned and
the actor acted on, with the state the actor held at its first row, over episode ends, two splits
stepped out of turn and the ring's wrap. (R2D2's learner on those sequences: tests/test_dqn.py.)"""

import dataclasses

import numpy as np
import pytest
from test_pipeline import EPISODE_LENGTHS, SPLIT_SIZE, TRUNCATING, ScriptedEnvPool, code

from helpers import load_script

from jax_async_rl import threads
from jax_async_rl.replay import Collecting
from jax_async_rl.sequences import SequenceReplay
from test_replay import chi2_bound

H = 3  # the recurrent state's size


class RecurrentStandIn:
    """A recurrent `act(params, obs, env_ids, steps, first) -> (actions, states)` whose state (c, h)
    is a function of the env's whole episode so far: c = 0.5 c + n, h = c + e, from zeros where an
    episode starts; its action encodes the observation. It records, for each (env, count), the
    state it acted from and `first`."""

    def __init__(self, num_envs):
        self.memory = (np.zeros((num_envs, H), np.float32), np.zeros((num_envs, H), np.float32))
        self.held, self.first = {}, {}

    def __call__(self, params, obs, env_ids, steps, first):
        c, h = (np.where(first[:, None], np.float32(0.0), m[env_ids]) for m in self.memory)
        e, n = np.asarray(obs, np.int64).T
        for i in range(len(e)):
            self.held[(e[i], n[i])], self.first[(e[i], n[i])] = (
                (c[i].copy(), h[i].copy()),
                bool(first[i]),
            )
        new_c = 0.5 * c + n[:, None]
        self.memory[0][env_ids], self.memory[1][env_ids] = new_c, new_c + e[:, None]
        return code(e, n), (c, h)


@dataclasses.dataclass
class RoundArgs:
    num_envs: int
    num_splits: int
    num_steps: int


def collector(envs, act, args: RoundArgs, shared=None):
    """collect(params) -> replay.Chunk: dqn_envpool.py's collection of one actor thread's chunks."""
    dqn = load_script("dqn_envpool.py")
    collecting, shared = Collecting(args.num_envs, 0, 0), shared or threads.Shared(None, 0)
    envs.async_reset()
    return lambda params: dqn.collect(envs, act, params, 0, collecting, args, shared, 0)


def reference_sequences(envs, count, rows, length, period, stack=1):
    """{(env, first row)} of the whole sequences a ring of `rows` rows an env keeps: starting on a
    multiple of `period`, all `length` rows written, the first one's stack not overwritten."""
    return {
        (e, s)
        for e in range(envs.num_envs)
        for s in range(0, int(count[e]) - length + 1, period)
        if s >= count[e] - rows + stack - 1
    }


@pytest.mark.parametrize("period, length", [(4, 9), (5, 5), (6, 3)])
def test_sampled_sequences_are_what_the_actor_saw_and_held(period, length):
    """Two splits of 3 envs out of turn, chunks of 7 steps, rings of 24 rows that wrap three
    times; sequences overlap (period < length), touch, or leave gaps. After every chunk, the live
    sequences are exactly the reference's, and each of 200 drawn (uniform and prioritised)
    is the envs' rows from its first: observations, the actions sent, rewards (0 on a reset row),
    terminations, truncations, and the state the actor acted from at its first row; the state at
    an episode's first row is zeros (the previous episode never carries over)."""
    num_envs, rows, rng = 2 * SPLIT_SIZE, 24, np.random.default_rng(period)
    envs = ScriptedEnvPool(
        num_envs, SPLIT_SIZE, EPISODE_LENGTHS[:num_envs], TRUNCATING, seed=period
    )
    act = RecurrentStandIn(num_envs)
    collect = collector(envs, act, RoundArgs(num_envs, 2, 7))
    state_example = (np.zeros((1, H), np.float32),) * 2
    replays = [
        SequenceReplay(
            rows * num_envs,
            num_envs,
            np.zeros((1, 2), np.float32),
            np.zeros(1, np.int64),
            state_example,
            length,
            period,
            alpha=alpha,
        )
        for alpha in (0.0, 0.9)
    ]
    starts_at_zero = 0
    for _ in range(14):
        chunk = collect(None)
        for replay in replays:
            replay.add(*chunk.rows)
        expected = reference_sequences(
            envs, replays[0].count, rows // period * period, length, period
        )
        for replay in replays:
            live = np.flatnonzero(replay.live)
            assert set(zip(*reversed([a.tolist() for a in replay.row_of(live)]))) == expected
            if not expected:  # the first chunk is shorter than a sequence
                continue
            batch = replay.sample(20, rng, beta=0.5, num_batches=5)
            assert batch["obs"].shape == (5, 20, length, 2) and batch["memory"][0].shape == (
                5,
                20,
                H,
            )
            for b, i in np.ndindex(5, 20):
                e, s = (int(v) for v in batch["obs"][b, i, 0])
                assert (e, s) in expected
                for k in range(length):
                    obs, reward, terminated, truncated = envs.returned[e][s + k]
                    np.testing.assert_array_equal(batch["obs"][b, i, k], obs)
                    assert batch["action"][b, i, k] == envs.received[e][s + k] == code(e, s + k)
                    assert batch["reward"][b, i, k] == (
                        0.0 if np.isnan(reward) else np.float32(reward)
                    )
                    assert (batch["terminated"][b, i, k], batch["truncated"][b, i, k]) == (
                        terminated,
                        truncated,
                    )
                for got, held in zip(batch["memory"], act.held[(e, s)]):
                    np.testing.assert_array_equal(got[b, i], held)
                starts_at_zero += act.first[(e, s)] and s > 0
                assert not act.first[(e, s)] or not any(batch["memory"][0][b, i])
    assert replays[0].count.min() > 3 * rows  # the ring wrapped
    assert starts_at_zero > 0  # some sequences begin where an episode does
    # The actor's `first`: an env's first observation, or the one after an episode's last.
    for (e, n), first in act.first.items():
        assert first == (n == 0 or envs.returned[e][n - 1][2] or envs.returned[e][n - 1][3])


def test_prioritised_sequences_in_proportion_and_renewed_at_the_largest_priority():
    """The sum tree over sequence slots: draws in proportion to p^alpha (chi-squared), importance
    weights (N P)^-beta normalised by the batch's largest, priorities of overwritten sequences
    dropped, a new sequence at the largest priority so far."""
    num_envs, rows, length, period, alpha, beta = 2, 40, 6, 4, 0.9, 0.6
    replay = SequenceReplay(
        rows * num_envs,
        num_envs,
        np.zeros((1, 1), np.float32),
        np.zeros(1, np.int64),
        (np.zeros((1, H), np.float32),),
        length,
        period,
        alpha=alpha,
    )

    def add(steps):
        for _ in range(steps):
            t = replay.count[0]
            replay.add(
                np.arange(num_envs),
                np.full((num_envs, 1), t, np.float32),
                np.zeros(num_envs, np.int64),
                np.zeros(num_envs),
                np.zeros(num_envs, bool),
                np.zeros(num_envs, bool),
                np.full(num_envs, t),
                (np.zeros((num_envs, H), np.float32),),
            )

    add(rows)
    live = np.flatnonzero(replay.live)
    assert len(live) == num_envs * ((rows - length) // period + 1)
    priorities = np.random.default_rng(0).random(len(live)) * 3
    replay.update_priorities(live, priorities)
    p = (priorities + replay.eps) ** alpha
    hits, rng = np.zeros(len(live)), np.random.default_rng(1)
    position = {s: i for i, s in enumerate(live)}
    for _ in range(300):
        batch = replay.sample(16, rng, beta=beta, num_batches=4)
        idx = np.vectorize(position.get)(batch["slots"])
        np.add.at(hits, idx, 1)
        w = (len(live) * p[idx] / p.sum()) ** -beta
        np.testing.assert_allclose(batch["weights"], w / w.max(axis=-1, keepdims=True), rtol=1e-5)
    expected = hits.sum() * p / p.sum()
    assert ((hits - expected) ** 2 / expected).sum() < chi2_bound(len(live) - 1)
    add(period)  # the oldest sequence of each env loses its first rows; a new one completes
    assert replay.tree.get(live[:num_envs]).sum() == 0 and not replay.live[live[:num_envs]].any()
    renewed = np.flatnonzero(replay.live & ~np.isin(np.arange(len(replay.live)), live))
    assert len(renewed) == num_envs
    np.testing.assert_allclose(replay.tree.get(renewed), replay.max_priority**alpha)
    assert replay.max_priority == pytest.approx(priorities.max() + replay.eps)


def test_atari_bytes_per_stored_step():
    """Pong's rows as the DQN script stores them (one 84 x 84 frame, an int64 action, the reward,
    two flags, the stack's reach back) and R2D2's 512-unit state (c and h, float32) once every 40
    rows with its slot's first row and liveness: 7,071 + 102.4 + 0.225 bytes a step, 7.17 GB for
    1M steps (a state on every row would add 4,096 bytes a step, 11.3 GB)."""
    from jax_async_rl import tasks

    obs_space, action_space = tasks.spaces("Pong-v5")
    rows, num_envs = 400, 4
    replay = SequenceReplay(
        rows * num_envs,
        num_envs,
        tasks.zeros_like_space(obs_space, 1),
        np.zeros(1, action_space.dtype),
        (np.zeros((1, 512), np.float32),) * 2,
        125,
        40,
        frame_stack=4,
    )
    arrays = [
        replay.obs,
        replay.action,
        replay.reward,
        replay.terminated,
        replay.truncated,
        replay.back,
        replay.begin,
        replay.live,
        *replay.state,
    ]
    per_step = sum(a.nbytes for a in arrays) / (rows * num_envs)
    assert per_step == pytest.approx(84 * 84 + 8 + 4 + 1 + 1 + 1 + 2 * 512 * 4 / 40 + (8 + 1) / 40)
    assert 7.17e9 < per_step * 1e6 < 7.18e9
