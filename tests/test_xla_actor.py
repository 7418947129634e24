"""--xla-actor: the rollout as one jitted loop over envpool's XLA interface.

The reference is independent of both actors: the actions a rollout recorded, replayed env by env
in a synchronous envpool (batch = all envs, same seeds), must give back the rollout's observations,
rewards, dones, bootstrap observations and games. envpool steps each env from its own seed, so an
env's trajectory depends only on its actions, not on which split it was stepped in.
"""

import dataclasses
import queue

import envpool
import jax
import numpy as np
import pytest
from helpers import ASYNC_SCRIPTS, load_script


def collect(module, env_id, num_envs, num_splits, num_rollouts, version=7, **flags):
    """`num_rollouts` rollouts and the games reported, from module.xla_actor_loop."""
    args = module.resolve_args(dataclasses.replace(
        module.Args(env_id=env_id, num_envs=num_envs, num_steps=16, num_splits=num_splits, xla_actor=True), **flags))
    network, _, continuous, normalizer, state = module.build(args, jax.random.PRNGKey(0))
    shared = module.Shared(dict(state, policy_version=version), normalizer)
    envs = module.make_env(env_id, num_envs, 3, 1, train=True, batch_size=num_envs // num_splits)
    rollouts = queue.Queue()
    module.xla_actor_loop(envs, module.make_policy_step(network, continuous, values=False), shared, rollouts,
                          jax.random.PRNGKey(1), args, num_rollouts, 0)
    envs.close()
    games = []
    while not shared.reports.empty():
        games += shared.reports.get()[1]["episodes"]
    return [rollouts.get_nowait() for _ in range(num_rollouts)], games, shared


def replay(env_id, num_envs, rollouts):
    """Step a synchronous envpool with the recorded actions: (obs, rewards, dones, truncated)
    [n + 1, B] and the games [(env, return, length)]."""
    envs = envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, seed=3, num_threads=1)
    obs, _ = envs.reset()
    seen, rewards, dones, truncs, games = [obs], [], [], [], []
    returns = np.zeros(num_envs)
    for rollout in rollouts:
        for action in rollout["actions"]:
            action = action if action.dtype.kind == "i" else np.clip(action, envs.action_space.low, envs.action_space.high)
            obs, reward, term, trunc, info = envs.step(np.asarray(action, envs.action_space.dtype))
            reward = np.where(info["elapsed_step"] > 0, reward, 0.0)
            returns += reward
            for e in np.flatnonzero(term | trunc):
                games.append((e, returns[e], info["elapsed_step"][e]))
                returns[e] = 0.0
            seen.append(obs), rewards.append(reward), dones.append(term | trunc), truncs.append(trunc)
    envs.close()
    return np.array(seen), np.array(rewards), np.array(dones), np.array(truncs), games


@pytest.mark.timeout(300)
@pytest.mark.parametrize("num_splits, ring", [(1, 2), (2, 2), (2, 1)])
@pytest.mark.parametrize("script", ASYNC_SCRIPTS)
def test_xla_rollouts_match_a_replay_of_their_actions(script, num_splits, ring, monkeypatch):
    """Ring 1: the first call stops short when envs finish the first rollout (their next step would
    leave the ring), and the ring grows (`grown`): the path an env that runs ahead takes."""
    module = load_script(script)
    monkeypatch.setattr(module, "XLA_RING", ring)
    grown, sizes = module.grown, []
    monkeypatch.setattr(module, "grown", lambda carry, R: sizes.append(R) or grown(carry, R))
    B, T, K = 8, 16, 5
    rollouts, games, shared = collect(module, "CartPole-v1", B, num_splits, K)
    obs, rewards, dones, truncs, replay_games = replay("CartPole-v1", B, rollouts)
    assert dones.any() and shared.sampled[0] >= K * T * B
    assert (sizes[:1] == [1]) == (ring == 1), sizes
    for k, rollout in enumerate(rollouts):
        rows = slice(k * T, (k + 1) * T)
        np.testing.assert_allclose(rollout["obs"], obs[rows], rtol=1e-6, err_msg=f"rollout {k}")
        np.testing.assert_allclose(rollout["bootstrap_obs"], obs[(k + 1) * T], rtol=1e-6, err_msg=f"rollout {k}")
        np.testing.assert_array_equal(rollout["rewards"], rewards[rows])
        np.testing.assert_array_equal(rollout["dones"], dones[rows])
        np.testing.assert_array_equal(rollout["truncated"], truncs[rows])
        # The step after an episode's end only resets the env: valid 0 (and its action is ignored).
        previous = np.concatenate([np.zeros((1, B), bool), dones])[rows]
        np.testing.assert_array_equal(rollout["valid"], 1.0 - previous)
        assert (rollout["policy_version"] == 7).all()
        assert rollout["logprobs"].shape == (T, B) and (rollout["logprobs"] < 0).all()
    # Every game that ended within the rollouts' steps was reported, in order, with its score and
    # length (the actor also ends games in the steps it took beyond the last rollout).
    assert replay_games
    for e in range(B):
        ours = [(r, n) for env, r, n in games if env == e]
        theirs = [(float(r), int(n)) for env, r, n in replay_games if env == e]
        assert ours[:len(theirs)] == theirs, f"env {e}"
