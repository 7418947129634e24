"""The replay buffer (jax_async_rl/replay.py) against plain references: n-step targets over
episode ends and truncations, written by splits out of turn; every complete transition and
nothing else can be sampled; the frame-based storage rebuilds exactly the stacks envpool
returned; prioritised sampling frequencies and importance weights against p^alpha / sum p^alpha."""

import threading

import envpool
import numpy as np
import pytest
from helpers import load_script

from jax_async_rl import devices, tasks
from jax_async_rl.flags import UsageError
from jax_async_rl.replay import Replay, SumTree


def chi2_bound(dof, z=3.09):
    """The chi-squared quantile at 1 - 1e-3 (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3


class Stream:
    """Envs that return envpool's rows: after an episode's last observation (terminated or
    truncated), the next row is the first observation (reward 0, elapsed 0). Observations are
    [env, row number], so that every sampled row names itself."""

    def __init__(self, num_envs, seed):
        self.rng = np.random.default_rng(seed)
        self.rows = [[] for _ in range(num_envs)]  # (reward, terminated, truncated, elapsed)

    def step(self, env_ids):
        out = []
        for e in env_ids:
            rows = self.rows[e]
            if not rows or rows[-1][1] or rows[-1][2]:
                row = (0.0, False, False, 0)
            else:
                end = self.rng.random() < 0.15
                terminated = end and self.rng.random() < 0.5
                row = (
                    float(self.rng.normal()),
                    terminated,
                    end and not terminated,
                    rows[-1][3] + 1,
                )
            rows.append(row)
            out.append((e, len(rows) - 1, *row))
        e, t, reward, terminated, truncated, elapsed = map(np.array, zip(*out))
        return np.stack([e, t], 1).astype(np.float32), reward, terminated, truncated, elapsed


def reference_target(rows, t, n, gamma):
    """(n-step return, discount, bootstrap row) by the definition: a loop over the rows."""
    ret = 0.0
    for k in range(1, n + 1):
        reward, terminated, truncated, _ = rows[t + k]
        ret += gamma ** (k - 1) * reward
        if terminated:
            return ret, 0.0, t + k
        if truncated:
            return ret, gamma**k, t + k
    return ret, gamma**n, t + n


@pytest.mark.parametrize("n_step", [1, 3])
def test_n_step_targets_and_exactly_the_complete_transitions(n_step):
    num_envs, split, rows, gamma = 6, 3, 40, 0.9
    stream = Stream(num_envs, seed=n_step)
    replay = Replay(
        rows * num_envs,
        num_envs,
        np.zeros((1, 2), np.float32),
        np.zeros(1, np.int32),
        n_step=n_step,
    )
    rng = np.random.default_rng(0)
    for step in range(300):  # the ring wraps several times; the two splits step out of turn
        env_ids = np.arange(split) + split * int(rng.integers(2))
        obs, reward, terminated, truncated, elapsed = stream.step(env_ids)
        replay.add(env_ids, obs, rng.integers(0, 4, split), reward, terminated, truncated, elapsed)
        if step % 25 != 24:
            continue
        # Complete transitions: kept, not an episode's last observation, n rows after it written.
        expected = set()
        for e in range(num_envs):
            count = len(stream.rows[e])
            for t in range(max(0, count - rows), count - n_step):
                if not (stream.rows[e][t][1] or stream.rows[e][t][2]):
                    expected.add((t, e))
        live = np.flatnonzero(replay.live)
        assert set(zip(*(a.tolist() for a in replay.row_of(live)))) == expected
        assert len(replay) == len(expected)
        batch = replay.sample(64, rng)
        # The target's math is the script's (dqn_envpool.py; sac's and td3's the same text).
        window = [batch[key] for key in ("rewards", "terminated", "truncated")]
        assert window[0].shape == (64, n_step)
        reward, discount = load_script("dqn_envpool.py").n_step_return(*window, gamma)
        for i in range(64):
            e, t = (int(v) for v in batch["obs"][i])
            assert (t, e) in expected
            ret, want, boot = reference_target(stream.rows[e], t, n_step, gamma)
            np.testing.assert_allclose(reward[i], ret, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(discount[i], want, rtol=1e-6)
            assert tuple(batch["next_obs"][i]) == (e, boot)
            assert batch["action"][i] == replay.action[t % rows, e]


@pytest.mark.parametrize("n_step, stack", [(1, 1), (3, 4)])
def test_a_chunk_added_in_one_call_is_its_steps_added_one_by_one(n_step, stack):
    """The rounds add a whole chunk at once (each env several times, splits out of turn): the
    buffer, its counts, its live slots and its sum tree end exactly as after the chunk's steps one
    at a time, over the ring's wrap, episode ends and stacks that reach back to overwritten rows."""
    num_envs, split, rows = 6, 3, 12
    stream, rng = Stream(num_envs, seed=stack), np.random.default_rng(1)
    obs_example = np.zeros((1, stack, 2), np.float32) if stack > 1 else np.zeros((1, 2), np.float32)
    one, chunked = (
        Replay(
            rows * num_envs,
            num_envs,
            obs_example,
            np.zeros(1, np.int32),
            n_step=n_step,
            frame_stack=stack,
            alpha=0.5,
        )
        for _ in range(2)
    )
    for _ in range(
        40
    ):  # chunks of up to 12 steps: an env's rows in one call can wrap its ring of 12
        steps = []
        for _ in range(int(rng.integers(1, 13))):
            env_ids = np.arange(split) + split * int(rng.integers(2))
            obs, reward, terminated, truncated, elapsed = stream.step(env_ids)
            obs = np.repeat(obs[:, None], stack, 1) if stack > 1 else obs
            steps.append(
                (env_ids, obs, rng.integers(0, 4, split), reward, terminated, truncated, elapsed)
            )
            one.add(*steps[-1])
        chunked.add(*(np.concatenate(x) for x in zip(*steps)))
        for name in ("obs", "action", "reward", "terminated", "truncated", "back", "count"):
            np.testing.assert_array_equal(getattr(chunked, name), getattr(one, name), err_msg=name)
        np.testing.assert_array_equal(chunked.live, one.live)
        np.testing.assert_array_equal(chunked.tree.tree, one.tree.tree)


def test_frame_storage_rebuilds_envpools_stacks_over_episode_starts():
    """Pong-v5, 2 splits stepped as the actors step them, episodes truncated every 15 steps, a
    ring of 30 rows an env: every row a sample could take (and its bootstrap) has the stack
    envpool returned, where episodes start, and after the ring wrapped."""
    num_envs, batch, rows, n_step = 4, 2, 30, 3
    envs = envpool.make(
        "Pong-v5",
        env_type="gymnasium",
        num_envs=num_envs,
        batch_size=batch,
        max_episode_steps=15,
        seed=1,
    )
    example = np.zeros((1, *envs.observation_space.shape), np.uint8)
    replay = Replay(
        rows * num_envs, num_envs, example, np.zeros(1, np.int32), n_step=n_step, frame_stack=4
    )
    whole = {}  # (row, env) -> the stack envpool returned
    rng, checked = np.random.default_rng(0), 0
    envs.async_reset()
    for step in range(200):
        obs, reward, terminated, truncated, info = envs.recv()
        env_ids = info["env_id"]
        actions = rng.integers(0, 6, batch)
        for k, e in enumerate(env_ids):
            whole[(int(replay.count[e]), int(e))] = obs[k]
        replay.add(env_ids, obs, actions, reward, terminated, truncated, info["elapsed_step"])
        envs.send(actions, env_ids)
        if step % 20 == 19:
            for e in range(num_envs):
                count = int(replay.count[e])
                t = np.arange(max(0, count - rows + 3), count)
                stacks = replay.stacked(t, np.full(len(t), e))
                for i, row in enumerate(t):
                    np.testing.assert_array_equal(
                        stacks[i], whole[(int(row), e)], err_msg=f"row {row} of env {e}"
                    )
                    checked += 1
            sample = replay.sample(32, rng)
            t, e = replay.row_of(sample["slots"])
            for i in range(32):
                np.testing.assert_array_equal(sample["obs"][i], whole[(int(t[i]), int(e[i]))])
    assert (
        replay.count.min() > 2 * rows and checked > 900
    )  # the ring wrapped twice (envpool's batches are uneven)
    assert (replay.back == 0).any() and (replay.back == 3).any()  # episode starts were crossed
    per_row = sum(
        a.nbytes
        for a in (
            replay.obs,
            replay.action,
            replay.reward,
            replay.terminated,
            replay.truncated,
            replay.back,
        )
    ) / (rows * num_envs)
    assert per_row == 84 * 84 + 4 + 4 + 1 + 1 + 1  # 7.07 GB for 1M rows


def test_sum_tree_finds_in_proportion_and_updates_repeated_indices():
    rng = np.random.default_rng(0)
    tree = SumTree(1000)
    values = rng.random(1000) * (rng.random(1000) < 0.7)
    tree.update(np.arange(1000), values)
    tree.update([3, 3, 5], [0.0, 2.0, 1.0])  # the last value wins
    values[3], values[5] = 2.0, 1.0
    np.testing.assert_allclose(tree.total, values.sum())
    hits = np.bincount(tree.find(rng.random(200_000) * tree.total), minlength=1000)
    assert hits[values == 0].sum() == 0
    expected = 200_000 * values / values.sum()
    keep = expected > 0
    assert ((hits[keep] - expected[keep]) ** 2 / expected[keep]).sum() < chi2_bound(keep.sum() - 1)
    assert tree.find([tree.total * (1 - 1e-16)])[0] == np.flatnonzero(values)[-1]


def test_uniform_draws_every_complete_transition_equally_often_and_nothing_else():
    """Uniform replay (rejection over the ring): the frequencies of 10^5 draws against equal ones
    (chi-squared), in a buffer where a third of the slots start no transition; weights all 1."""
    num_envs, rows = 3, 50
    stream, rng = Stream(num_envs, seed=7), np.random.default_rng(3)
    replay = Replay(
        rows * num_envs, num_envs, np.zeros((1, 2), np.float32), np.zeros(1, np.int32), n_step=3
    )
    for _ in range(40):  # the ring not full: slots of rows not written yet start nothing either
        obs, reward, terminated, truncated, elapsed = stream.step(np.arange(num_envs))
        replay.add(
            np.arange(num_envs),
            obs,
            np.zeros(num_envs, np.int32),
            reward,
            terminated,
            truncated,
            elapsed,
        )
    live = np.flatnonzero(replay.live)
    assert 0 < len(live) < 0.8 * rows * num_envs
    batch = replay.sample(1000, rng, num_batches=100)
    assert batch["obs"].shape == (100, 1000, 2) and np.all(batch["weights"] == 1)
    hits = np.bincount(np.ravel(batch["slots"]), minlength=rows * num_envs)
    assert hits.sum() == hits[live].sum() == 100_000
    expected = 100_000 / len(live)
    assert ((hits[live] - expected) ** 2 / expected).sum() < chi2_bound(len(live) - 1)


def test_prioritised_frequencies_and_importance_weights():
    num_envs, rows, alpha, beta = 2, 64, 0.6, 0.4
    replay = Replay(
        rows * num_envs, num_envs, np.zeros((1, 2), np.float32), np.zeros(1, np.int32), alpha=alpha
    )
    for t in range(rows):  # one long episode an env
        replay.add(
            np.arange(num_envs),
            np.zeros((2, 2), np.float32),
            np.zeros(2, np.int32),
            np.zeros(2),
            np.zeros(2, bool),
            np.zeros(2, bool),
            np.full(2, t),
        )
    assert len(replay) == num_envs * (rows - 1)
    live = np.flatnonzero(replay.live)
    rng = np.random.default_rng(1)
    td = rng.normal(size=len(live)) * 3
    replay.update_priorities(live, td)
    p = (np.abs(td) + replay.eps) ** alpha
    probs = p / p.sum()
    hits = np.zeros(len(live))
    position = {s: i for i, s in enumerate(live)}
    for i in range(400):  # every other draw a learner's round: 4 batches of 64 at once
        batch = (
            replay.sample(256, rng, beta=beta)
            if i % 2
            else replay.sample(64, rng, beta=beta, num_batches=4)
        )
        assert batch["obs"].shape == ((256, 2) if i % 2 else (4, 64, 2))
        idx = np.array([position[s] for s in np.ravel(batch["slots"])]).reshape(
            batch["slots"].shape
        )
        np.add.at(hits, idx, 1)
        w = (len(live) * probs[idx]) ** -beta
        np.testing.assert_allclose(batch["weights"], w / w.max(axis=-1, keepdims=True), rtol=1e-5)
        # each batch spans the buffer (the stratified targets shuffled), not a quarter of it
        if not i % 2:
            assert all(len(set(np.unique(b // (len(live) // 4)).tolist())) >= 3 for b in idx)
    expected = hits.sum() * probs
    assert ((hits - expected) ** 2 / expected).sum() < chi2_bound(len(live) - 1)
    # New transitions come in at the largest priority so far.
    assert replay.max_priority == pytest.approx(np.abs(td).max() + replay.eps)


def test_round_flags_are_checked_and_give_whole_gradient_steps():
    """check_rounds: the replay scripts' round flags, one line each; gradient_steps: ratio x
    round / batch."""
    from types import SimpleNamespace

    from jax_async_rl.flags import UsageError
    from jax_async_rl.replay import check_rounds, gradient_steps

    good = dict(
        num_envs=4,
        num_splits=2,
        num_steps=8,
        replay_ratio=2.0,
        batch_size=16,
        buffer_size=1000,
        learning_starts=64,
        learner_device_ids=[0],
        actor_device_ids=[0],
    )
    check_rounds(SimpleNamespace(**good), 5)
    assert gradient_steps(SimpleNamespace(**good)) == 4  # 2 x 32 env steps / 16
    for change, flag in [
        (dict(num_splits=3), "--num-splits"),
        (dict(replay_ratio=1.7), "--replay-ratio"),
        (dict(replay_ratio=0.25), "--replay-ratio"),
        (dict(buffer_size=63), "--buffer-size"),
        (dict(buffer_size=20 * 4), "--buffer-size"),
        (dict(learner_device_ids=[0, 1, 2]), "--batch-size"),
    ]:
        with pytest.raises(UsageError, match=flag):
            check_rounds(SimpleNamespace(**{**good, **change}), 20)


def test_legal_action_masks_are_stored_as_bits_and_given_back_as_the_env_gave_them():
    """Minesweeper's (10, 10) int8 mask: 13 bytes a row (100 bits), not 100 (or 400 as floats);
    a sampled transition's masks are those of its observation and of the next one."""
    rng = np.random.default_rng(0)
    num_envs, steps = 3, 12
    obs = [
        {
            "board": rng.integers(-1, 9, (num_envs, 10, 10)).astype(np.int32),
            "action_mask": (rng.random((num_envs, 10, 10)) < 0.7).astype(np.int8),
        }
        for _ in range(steps)
    ]
    replay = Replay(num_envs * 20, num_envs, obs[0], np.zeros(1, np.int64))
    assert (
        replay.obs["action_mask"].shape == (20, num_envs, 13)
        and replay.obs["action_mask"].dtype == np.uint8
    )
    for t in range(steps):
        replay.add(
            np.arange(num_envs),
            obs[t],
            np.zeros(num_envs, np.int64),
            np.full(num_envs, float(t)),
            np.zeros(num_envs, bool),
            np.zeros(num_envs, bool),
            np.full(num_envs, t),
        )
    batch = replay.sample(64, rng)
    t, e = replay.row_of(batch["slots"])
    for key in ("board", "action_mask"):
        assert batch["obs"][key].dtype == obs[0][key].dtype
        np.testing.assert_array_equal(
            batch["obs"][key], np.stack([obs[i][key][j] for i, j in zip(t, e)])
        )
        np.testing.assert_array_equal(
            batch["next_obs"][key], np.stack([obs[i + 1][key][j] for i, j in zip(t, e)])
        )


def test_a_buffer_larger_than_the_available_memory_is_refused(monkeypatch):
    """check_rounds, as a run starts: Pong's 3M rows take 84 x 84 (one frame: stacks are rebuilt)
    + 8 (the action) + 7 bytes each, more than 90% of 20 GiB; 1M rows fit. utils/evaluate.py,
    which resolves a run's flags outside a run and allocates no buffer, is not refused."""
    dqn = load_script("dqn_envpool.py")
    monkeypatch.setattr(devices, "available_memory", lambda: 20 * 2**30)
    monkeypatch.setattr(tasks, "RUN_STOP", [threading.Event()])  # a run is starting
    with pytest.raises(
        UsageError,
        match=r"^--buffer-size 3,000,000: .* 19\.8 GiB \(its 3,000,000 rows of 7,071 bytes, "
        r"Atari frames stored once\), more than 90% of the 20\.0 GiB",
    ):
        dqn.resolve_args(dqn.Args(env_id="Pong-v5", buffer_size=3_000_000))
    dqn.resolve_args(dqn.Args(env_id="Pong-v5", buffer_size=1_000_000))
    monkeypatch.setattr(tasks, "RUN_STOP", [None])
    dqn.resolve_args(dqn.Args(env_id="Pong-v5", buffer_size=3_000_000))
