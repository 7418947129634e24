"""appo_envpool_xla.py: the rollout as one jitted loop over envpool's XLA interface.

The reference is independent of both actors: the actions a rollout recorded, replayed env by env
in a synchronous envpool (batch = all envs, same seeds), must give back the rollout's observations,
rewards, dones, bootstrap observations and games. envpool steps each env from its own seed, so an
env's trajectory depends only on its actions, not on which split it was stepped in.
"""

import queue

import envpool
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_script
from jax_async_rl import tasks, threads

SCRIPT = "appo_envpool_xla.py"


def collect(module, env_id, num_envs, num_splits, num_rollouts, version=7, num_steps=16, **flags):
    """From the script's actor_loop: `num_rollouts` rollouts, the games reported, `Shared`, and the
    network and whether its actions are continuous."""
    args = module.resolve_args(
        module.Args(
            env_id=env_id, num_envs=num_envs, num_steps=num_steps, num_splits=num_splits, **flags
        )
    )
    network, _, continuous, normalizer, state = module.build(args, jax.random.PRNGKey(0))
    shared = threads.Shared(state["params"], version, normalizer)
    envs = tasks.make_env(env_id, num_envs, 3, 1, train=True, batch_size=num_envs // num_splits)
    rollouts = queue.Queue()
    module.actor_loop(
        envs,
        module.make_policy_step(network, continuous, values=False),
        shared,
        rollouts,
        jax.random.PRNGKey(1),
        args,
        tasks.policy_space(args.env_id),
        num_rollouts,
    )
    envs.close()
    rollouts = [rollouts.get_nowait() for _ in range(num_rollouts)]
    return (
        rollouts,
        [game for rollout in rollouts for game in rollout.games],
        shared,
        network,
        continuous,
    )


def replay(env_id, num_envs, rollouts, module=None):
    """Step a synchronous envpool (as `module` makes it for training, else envpool's defaults) with
    the recorded actions: (obs, rewards, dones, truncated) [n + 1, B] and the games [(env, return,
    length)]."""
    envs = (
        tasks.make_env(env_id, num_envs, 3, 1, train=True)
        if module
        else envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, seed=3, num_threads=1)
    )
    obs, _ = envs.reset()
    seen, rewards, dones, truncs, games = [obs], [], [], [], []
    returns = np.zeros(num_envs)
    for rollout in rollouts:
        for action in rollout.actions:
            action = (
                action
                if action.dtype.kind == "i"
                else np.clip(action, envs.action_space.low, envs.action_space.high)
            )
            obs, reward, term, trunc, info = envs.step(np.asarray(action, envs.action_space.dtype))
            reward = np.where(info["elapsed_step"] > 0, reward, 0.0)
            returns += reward
            for e in np.flatnonzero(term | trunc):
                games.append((e, returns[e], info["elapsed_step"][e]))
                returns[e] = 0.0
            (
                seen.append(obs),
                rewards.append(reward),
                dones.append(term | trunc),
                truncs.append(trunc),
            )
    envs.close()
    return np.array(seen), np.array(rewards), np.array(dones), np.array(truncs), games


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "env_id, num_splits, ring, lstm",
    [
        ("CartPole-v1", 1, 2, False),
        ("CartPole-v1", 2, 2, False),
        ("CartPole-v1", 2, 1, False),
        ("Pendulum-v1", 2, 2, False),
        ("HalfCheetah-v4", 2, 2, False),
        ("CartPole-v1", 2, 1, True),
        ("MountainCar-v0", 2, 2, False),  # 200-step games of return -200: a return is not a length
        ("Pong-v5", 2, 2, False),
    ],
)  # uint8 images, the game score in info (training: lives end episodes)
def test_xla_rollouts_match_a_replay_of_their_actions(env_id, num_splits, ring, lstm, monkeypatch):
    """Ring 1: the first call stops short when envs finish the first rollout (their next step would
    leave the ring), and the ring grows (`grown`): the path an env that runs ahead takes. The
    log-probabilities are recomputed by the learner's forward pass (with --lstm, from the state
    the rollout recorded), and with --lstm that state from the replayed observations."""
    module = load_script(SCRIPT)
    monkeypatch.setattr(module, "XLA_RING", ring)
    grown, sizes = module.grown, []
    monkeypatch.setattr(module, "grown", lambda carry, R: sizes.append(R) or grown(carry, R))
    B, T, K = 8, 16, {"MountainCar-v0": 14, "Pong-v5": 12}.get(env_id, 5)
    rollouts, games, shared, network, continuous = collect(
        module, env_id, B, num_splits, K, norm_obs=False, norm_reward=False, lstm=lstm
    )
    obs, rewards, dones, truncs, replay_games = replay(env_id, B, rollouts, module)
    assert shared.sampled[0] >= K * T * B and (
        dones.any() or env_id not in ("CartPole-v1", "MountainCar-v0")
    )
    assert (rewards != 0).any() or env_id != "Pong-v5"  # points were scored
    assert (sizes[:1] == [1]) == (ring == 1), sizes
    for k, rollout in enumerate(rollouts):
        rows = slice(k * T, (k + 1) * T)
        np.testing.assert_allclose(rollout.obs, obs[rows], rtol=1e-6, err_msg=f"rollout {k}")
        np.testing.assert_allclose(
            rollout.bootstrap_obs, obs[(k + 1) * T], rtol=1e-6, err_msg=f"rollout {k}"
        )
        np.testing.assert_allclose(rollout.rewards, rewards[rows], rtol=1e-6)
        np.testing.assert_array_equal(rollout.dones, dones[rows])
        np.testing.assert_array_equal(rollout.truncated, truncs[rows])
        # The step after an episode's end only resets the env: valid 0 (and its action is ignored).
        previous = np.concatenate([np.zeros((1, B), bool), dones])[rows]
        np.testing.assert_array_equal(rollout.valid, 1.0 - previous)
        assert (rollout.policy_version == 7).all()
        params = shared.latest[0]
        logprobs = module.rollout_forward(
            network, params, jax.tree.map(jnp.asarray, rollout.arrays()), continuous
        )[0]
        np.testing.assert_allclose(rollout.logprobs, logprobs, atol=1e-4, err_msg=f"rollout {k}")
        if lstm:  # episodes start at step 0 and 2 steps after an end (the step between: the reset);
            # the state before row 0: from those starts, fed every observation before it
            starts = np.concatenate([np.ones((1, B), bool), np.zeros((1, B), bool), dones[:-2]])
            np.testing.assert_array_equal(rollout.first, starts[rows])
            core = module.zero_core(network.lstm_size, B)
            if k:
                _, _, core = network.apply(params, obs[: k * T], (core[0], starts[: k * T]))
            np.testing.assert_allclose(
                rollout.state, core[0] if not k else core, atol=1e-5, err_msg=f"rollout {k}"
            )
    # Every game that ended within the rollouts' steps was reported, in order, with its score and
    # length (the actor also ends games in the steps it took beyond the last rollout).
    assert replay_games or env_id not in ("CartPole-v1", "MountainCar-v0")
    for e in range(B):
        ours = [(r, n) for env, r, n in games if env == e]
        theirs = [(float(r), int(n)) for env, r, n in replay_games if env == e]
        assert ours[: len(theirs)] == theirs, f"env {e}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("env_id", ["Acrobot-v1", "HalfCheetah-v4"])
def test_xla_normaliser_counts_every_observation(env_id):
    """These presets normalise observations and rewards (HalfCheetah's are float64, which JAX then
    takes with x64 in the actor's thread): the host statistics (which checkpoints save) gain every
    observation the jitted loop saw, once, and the rollout holds observations normalised by them."""
    module = load_script(SCRIPT)
    B, K = 4, 3
    rollouts, _, shared, _, _ = collect(module, env_id, B, 2, K, num_steps=16)
    obs_mean, obs_var, count = shared.normalizer.obs_stats
    _, return_var, return_count = shared.normalizer.return_stats
    sampled = int(shared.sampled[0])  # one observation per action sent (the first ones: resets)
    assert count == pytest.approx(1e-4 + sampled) and return_count == pytest.approx(1e-4 + sampled)
    raw = replay(env_id, B, rollouts)[0]
    # Most of what the actor saw is replayed (it steps up to 2 rollouts beyond the last one queued).
    np.testing.assert_allclose(
        obs_mean, raw.reshape(-1, raw.shape[-1]).mean(0), atol=0.2 * np.sqrt(obs_var).max()
    )
    normalised = np.concatenate([r.obs for r in rollouts])
    assert np.abs(normalised).max() <= 10.0 and 0.3 < normalised.std() < 3.0
    assert np.abs(np.concatenate([r.rewards for r in rollouts])).max() <= 10.0 and return_var > 0
