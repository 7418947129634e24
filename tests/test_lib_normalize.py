"""jax_async_rl.normalize: CleanRL's observation and reward normalisation against plain loops of
gym's RunningMeanStd and NormalizeReward, on vectors and on nested dicts; the arithmetic shared
with a jitted loop (numpy and jax.numpy give the same numbers); statistics merged from elsewhere."""

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_async_rl import normalize
from jax_async_rl.normalize import Normalizer


def pooled(x, prior_weight=1e-4):
    """Mean and variance of the samples x [N, ...] pooled with a prior of mean 0 and variance 1."""
    total = prior_weight + len(x)
    mean = x.sum(0) / total
    var = (prior_weight * (1.0 + mean**2) + ((x - mean) ** 2).sum(0)) / total
    return mean, var


def test_normalizer_matches_plain_statistics():
    """After batches from two envs stepping out of order, the observation statistics are the mean
    and variance of every observation seen, pooled with gym's RunningMeanStd prior (mean 0,
    variance 1, weight 1e-4), and each reward is divided by the std of all per-env discounted
    returns so far, computed by a plain loop of gym's NormalizeReward: ret = ret * gamma + r,
    reset at episode ends."""
    rng = np.random.default_rng(0)
    gamma = 0.9
    norm = Normalizer(np.zeros(3), 2, True, True, gamma)
    seen_obs, seen_returns, ret = [], [], np.zeros(2)
    for step in range(40):
        env_ids = np.array([[0, 1], [1], [0]][step % 3])
        obs = rng.normal(2.0, 3.0, size=(len(env_ids), 3))
        reward = rng.normal(size=len(env_ids))
        done = rng.random(len(env_ids)) < 0.2
        seen_obs.extend(obs)
        got = norm.observe(obs)
        mean, var = pooled(np.array(seen_obs))
        want = np.clip((obs - mean) / np.sqrt(var + 1e-8), -10, 10)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        scaled = norm.reward(reward, done, env_ids)
        for i, env in enumerate(env_ids):
            ret[env] = ret[env] * gamma + reward[i]
            seen_returns.append(ret[env])
        want_reward = np.clip(reward / np.sqrt(pooled(np.array(seen_returns))[1] + 1e-8), -10, 10)
        np.testing.assert_allclose(scaled, want_reward, rtol=1e-3)
        ret[env_ids[done]] = 0.0
    # Evaluation applies the statistics without moving them.
    stats = norm.obs_stats
    norm.observe(rng.normal(size=(5, 3)), train=False)
    assert norm.obs_stats is stats


def test_normalizer_off_passes_through():
    norm = Normalizer(np.zeros(3), 2, False, False, 0.99)
    obs, reward = np.ones((2, 3)), np.array([1.0, 2.0])
    assert (
        norm.observe(obs) is obs and norm.reward(reward, np.zeros(2, bool), np.arange(2)) is reward
    )
    assert norm.state() == {}


def test_normalizer_of_a_dict_matches_plain_statistics():
    """Running statistics per float leaf of a nested dict equal numpy's over all batches seen;
    integer and bool leaves pass through untouched."""
    rng = np.random.default_rng(0)
    batches = [
        {
            "a": rng.normal(3, 2, (4, 3)),
            "b": {
                "c": rng.normal(-1, 5, (4,)).astype(np.float32),
                "d": rng.integers(0, 9, (4, 2)),
                "e": rng.random((4, 2)) > 0.5,
            },
        }
        for _ in range(3)
    ]
    norm = Normalizer(jax.tree.map(lambda x: x[0], batches[0]), 4, True, False, 0.99)
    for batch in batches:
        out = norm.observe(batch)
    mean, var, count = norm.obs_stats
    for path in (("a",), ("b", "c")):
        pick = lambda tree: functools.reduce(lambda node, key: node[key], path, tree)  # noqa: E731
        data = np.concatenate([pick(b) for b in batches])
        np.testing.assert_allclose(pick(mean), data.mean(0), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(pick(var), data.var(0), rtol=1e-3)
        expected = np.clip((pick(batches[-1]) - pick(mean)) / np.sqrt(pick(var) + 1e-8), -10, 10)
        np.testing.assert_allclose(pick(out), expected, rtol=1e-5, atol=1e-5)
    assert out["b"]["d"] is batches[-1]["b"]["d"] and out["b"]["e"] is batches[-1]["b"]["e"]
    assert count == pytest.approx(12, abs=1e-3)


def test_combined_moments_equal_the_moments_of_all_samples_in_numpy_and_jax():
    """Chan et al.'s merge of two sets' (mean, variance, count), leaf by leaf, is the moments of
    their union; the same functions run on jax.numpy arrays (inside a jitted loop) and agree."""
    rng = np.random.default_rng(1)
    a = {"x": rng.normal(2, 3, (7, 3)), "y": rng.normal(size=(7,))}
    b = {"x": rng.normal(-1, 1, (5, 3)), "y": rng.normal(4, 2, (5,))}
    both = jax.tree.map(lambda u, v: np.concatenate([u, v]), a, b)
    mean, var, n = normalize.combined(normalize.moments(a), normalize.moments(b))
    assert n == 12
    for key in ("x", "y"):
        np.testing.assert_allclose(mean[key], both[key].mean(0), rtol=1e-12)
        np.testing.assert_allclose(var[key], both[key].var(0), rtol=1e-12)
    merged = jax.jit(lambda a, b: normalize.combined(normalize.moments(a), normalize.moments(b)))(
        jax.tree.map(jnp.float32, a), jax.tree.map(jnp.float32, b)
    )
    for got, want in zip(jax.tree.leaves(merged[:2]), jax.tree.leaves((mean, var))):
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_the_scaling_is_the_same_in_numpy_and_jax():
    rng = np.random.default_rng(2)
    x, m, v = rng.normal(0, 30, (6, 4)), rng.normal(size=4), rng.random(4) + 0.1
    np.testing.assert_allclose(
        normalize.scaled_obs(jnp.float32(x), m, v, jnp),
        normalize.scaled_obs(x, m, v, np),
        rtol=1e-5,
    )
    assert normalize.scaled_obs(x, m, v, np).max() == 10.0
    ints = np.arange(4)
    assert normalize.scaled_obs(ints, 0.0, 1.0, np) is ints
    r = rng.normal(0, 50, 8)
    np.testing.assert_allclose(
        normalize.scaled_reward(jnp.float32(r), 4.0, jnp),
        normalize.scaled_reward(r, 4.0, np),
        rtol=1e-5,
    )


def test_merge_adds_statistics_gathered_elsewhere_and_snapshot_reads_both():
    """A sampler that normalised on its own (appo_envpool_xla.py's jitted loop) hands back the
    moments of its samples; merged, the host's statistics are those of every sample."""
    rng = np.random.default_rng(3)
    here, there = rng.normal(1, 2, (10, 3)), rng.normal(-2, 1, (6, 3))
    norm = Normalizer(np.zeros(3), 2, True, True, 0.9)
    norm.observe(here)
    norm.merge(normalize.moments(there), normalize.moments(np.array([1.0, 3.0])))
    obs_stats, return_stats = norm.snapshot()
    mean, var = pooled(np.concatenate([here, there]))
    np.testing.assert_allclose(obs_stats[0], mean, rtol=1e-6)
    np.testing.assert_allclose(obs_stats[1], var, rtol=1e-6)
    assert obs_stats[2] == pytest.approx(16 + 1e-4) and return_stats[2] == pytest.approx(2 + 1e-4)


def test_the_statistics_travel_with_a_checkpoint():
    norm = Normalizer(np.zeros(3), 2, True, True, 0.99)
    norm.observe(np.arange(12, dtype=np.float64).reshape(4, 3))
    norm.reward(np.array([1.0, -2.0]), np.array([False, True]), np.array([0, 1]))
    state = jax.tree.map(np.copy, norm.state())
    fresh = Normalizer(np.zeros(3), 2, True, True, 0.99)
    fresh.load(dict(state))
    for saved, loaded in zip(
        (*norm.obs_stats, *norm.return_stats), (*fresh.obs_stats, *fresh.return_stats)
    ):
        np.testing.assert_array_equal(np.asarray(loaded), np.asarray(saved))


def test_actor_threads_taking_turns_see_the_same_statistics_whenever_their_steps_come():
    """Normalizer.in_turn (--deterministic, several actor threads): two threads' batches fed in
    different interleavings, one thread running up to a turn ahead of the other, give each thread
    the same normalised observations and rewards, and the normaliser the same statistics: every
    thread's turns, merged turn by turn in thread order. One thread, or nothing normalised: the
    normaliser itself (no turns, as without --deterministic)."""
    rng = np.random.default_rng(4)
    B, T, turns = 2, 3, 4  # each thread: B envs, turns of T x B observations in batches of 1 env
    batches = [
        [
            (rng.normal(t, 2.0, (1, 3)), rng.normal(size=1), rng.random(1) < 0.3, np.array([e]))
            for _ in range(turns)
            for _ in range(T)
            for e in range(B)
        ]
        for t in range(2)
    ]

    def run(order):
        shared = Normalizer(np.zeros(3), 2 * B, True, True, 0.9)
        stop = threading.Event()
        views = [shared.in_turn(t, B, T, stop) for t in range(2)]
        seen = [[], []]

        def feed(t, k):
            obs, reward, done, env = batches[t][k]
            seen[t].append(views[t].observe(obs))
            seen[t].append(views[t].reward(reward, done, env + t * B))

        # Each thread in its own Python thread: a turn's end waits for the other's.
        workers = [
            threading.Thread(target=lambda t=t: [feed(t, k) for k in order[t]]) for t in range(2)
        ]
        for worker in workers if order[2] else workers[::-1]:
            worker.start()
        for worker in workers:
            worker.join(10)
        assert not any(worker.is_alive() for worker in workers)
        return seen, shared.snapshot()

    steps = range(turns * T * B)
    first, first_stats = run([steps, steps, True])
    second, second_stats = run([steps, steps, False])
    np.testing.assert_equal(first, second)
    np.testing.assert_equal(first_stats, second_stats)
    # The normaliser holds the turns all threads ended (the last is still each thread's own).
    assert first_stats[0][2] == pytest.approx(1e-4 + 2 * (turns - 1) * T * B)
    shared = Normalizer(np.zeros(3), B, True, True, 0.9)
    assert shared.in_turn(0, B, T, threading.Event()) is shared
    off = Normalizer(np.zeros(3), 2 * B, False, False, 0.9)
    assert off.in_turn(1, B, T, threading.Event()) is off
