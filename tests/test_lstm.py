"""Recurrent policies (--lstm): the learner's unroll from the recorded states reproduces what the
actor computed step by step, through envpool's out-of-order splits and episode ends; minibatches
are whole env sequences; a memory task is learned with --lstm and not without it."""

import dataclasses
import json

import gymnasium
import jax
import numpy as np
import pytest

from helpers import (
    PYTHON_ACTOR_SCRIPTS,
    check_run_files,
    cli,
    evaluate_here,
    load_script,
    read_metrics,
    run_main,
    tag_values,
)
from jax_async_rl import evaluation, tasks, threads
from jax_async_rl.normalize import Normalizer
from test_pipeline import EPISODE_LENGTHS, NUM_STEPS, SPLIT_SIZE, TRUNCATING, ScriptedEnvPool, drain

LSTM_SIZE = 8
ENCODERS = (
    ("flat", 0.05),
)  # observations [e, n] (env, count): scaled into a range a tanh cell uses


class RecordingPolicy:
    """The script's jitted policy_step, recording the value the actor computed for each
    observation [e, n] it acted on: values[(e, n)]."""

    def __init__(self, policy_step):
        self.policy_step, self.values = policy_step, {}

    def __call__(self, params, obs, core, key, env_ids, steps):
        action, logprob, value, state = self.policy_step(params, obs, core, key, env_ids, steps)
        for (e, n), v in zip(np.asarray(obs, np.int64), np.asarray(value)):
            self.values[(int(e), int(n))] = float(v)
        return action, logprob, value, state


def lstm_network(module, num_actions=3):
    network = module.ActorCritic(num_actions, False, ENCODERS, LSTM_SIZE)
    params = network.init(
        jax.random.PRNGKey(0), np.zeros((1, 2), np.float32), module.zero_core(LSTM_SIZE, 1)
    )
    # Larger recurrent weights than the initialisation's: the state then carries more of the past,
    # and a wrong state (or a missed reset) changes the outputs well beyond the tolerance.
    params = jax.tree.map(lambda x: x * 3.0, params)
    return network, params


def first_flags(envs, e, n):
    """Whether env e's n-th observation starts an episode: its first, or the one after an end."""
    if n == 0:
        return True
    _, _, term, trunc = envs.returned[e][n - 1]
    return term or trunc


@pytest.mark.timeout(300)
@pytest.mark.parametrize("num_splits", [1, 2, 4])
@pytest.mark.parametrize("script", PYTHON_ACTOR_SCRIPTS)
def test_learner_unroll_reproduces_the_actor(script, num_splits):
    """For fixed parameters, rollout_forward (the learner's unroll from each rollout's recorded
    states, resetting where episodes start) gives the actor's per-step log-probabilities and
    values to 1e-5, for every (env, step), with envs returned out of order and episodes ending
    mid-rollout; the bootstrap value is the actor's value of the next rollout's first row."""
    module = load_script(script)
    network, params = lstm_network(module)
    num_envs = num_splits * SPLIT_SIZE
    envs = ScriptedEnvPool(
        num_envs, SPLIT_SIZE, EPISODE_LENGTHS[:num_envs], TRUNCATING, seed=num_splits
    )
    envs.action_space = gymnasium.spaces.Discrete(3)
    shared = threads.Shared(params, 0)
    args = dataclasses.replace(
        module.Args(env_id="CartPole-v1"),
        num_envs=num_envs,
        num_steps=NUM_STEPS,
        num_splits=num_splits,
        lstm=True,
        lstm_size=LSTM_SIZE,
    )
    policy = RecordingPolicy(module.make_policy_step(network, continuous=False))
    rollout_queue, num_rollouts, T = module.queue.Queue(), 5, NUM_STEPS
    module.actor_loop(
        envs,
        policy,
        shared,
        rollout_queue,
        jax.random.PRNGKey(0),
        args,
        tasks.policy_space(args.env_id),
        num_rollouts,
    )
    assert not envs.errors, envs.errors
    rollouts = drain(rollout_queue)
    assert len(rollouts) == num_rollouts
    if num_splits > 1:  # the splits really ran out of step with each other
        assert envs.count.max() > envs.count.min()
    resets_inside = 0
    for k, rollout in enumerate(rollouts):
        logprobs, _, values, bootstrap_value = jax.device_get(
            jax.jit(module.rollout_forward, static_argnums=(0, 3))(
                network, params, rollout.arrays(), False
            )
        )
        for e in range(num_envs):
            for t in range(T):
                n, where = k * T + t, f"rollout {k}, row {t}, env {e}"
                assert tuple(rollout.obs[t, e]) == (e, n), where
                assert rollout.first[t, e] == first_flags(envs, e, n), where
                resets_inside += t > 0 and first_flags(envs, e, n)
                np.testing.assert_allclose(
                    logprobs[t, e], rollout.logprobs[t, e], atol=1e-5, err_msg=where
                )
                np.testing.assert_allclose(
                    values[t, e], policy.values[(e, n)], atol=1e-5, err_msg=where
                )
            np.testing.assert_allclose(
                bootstrap_value[e], policy.values[(e, (k + 1) * T)], atol=1e-5, err_msg=f"{k}, {e}"
            )
    assert resets_inside > 5  # episodes started mid-rollout, not only at rollout boundaries

    # The check can fail: ignoring the recorded state, or the resets, changes the outputs.
    rollout = rollouts[-1]
    for wrong in (
        dict(rollout.arrays(), state=jax.tree.map(np.zeros_like, rollout.state)),
        dict(rollout.arrays(), first=np.zeros_like(rollout.first)),
    ):
        _, _, values, _ = module.rollout_forward(network, params, wrong, False)
        expected = [
            [policy.values[(e, (num_rollouts - 1) * T + t)] for e in range(num_envs)]
            for t in range(T)
        ]
        assert np.abs(np.asarray(values) - np.array(expected)).max() > 1e-3


@pytest.mark.timeout(300)
def test_sync_rollouts_unroll_to_the_actors_numbers():
    """The sync baseline's collect_rollout on real envpool CartPole (episodes end mid-rollout),
    rollout after rollout: the learner's unroll gives the stored log-probabilities and values."""
    ppo = load_script("ppo_sync_baseline.py")
    network = ppo.ActorCritic(2, False, (("flat", 1.0),), LSTM_SIZE)
    params = network.init(
        jax.random.PRNGKey(1), np.zeros((1, 4), np.float32), ppo.zero_core(LSTM_SIZE, 1)
    )
    params = jax.tree.map(lambda x: x * 3.0, params)
    args = dataclasses.replace(
        ppo.Args(env_id="CartPole-v1"), num_envs=4, num_steps=16, lstm=True, lstm_size=LSTM_SIZE
    )
    envs = tasks.make_env("CartPole-v1", 4, 0, 1, train=True)
    normalizer = Normalizer(np.zeros(4), 4, False, False, 0.99)
    obs, dones, core = envs.reset()[0], np.zeros(4, bool), ppo.zero_core(LSTM_SIZE, 4)
    policy_step, key = ppo.make_policy_step(network, False), jax.random.PRNGKey(0)
    timing, stats, starts = dict.fromkeys(["env", "inference"], 0.0), tasks.EpisodeStats(4), 0
    forward = jax.jit(ppo.rollout_forward, static_argnums=(0, 3))
    previous = None
    for k in range(6):
        rollout, obs, dones, core = ppo.collect_rollout(
            envs,
            policy_step,
            params,
            obs,
            dones,
            core,
            key,
            k * args.num_steps,
            stats,
            normalizer,
            args,
            tasks.policy_space(args.env_id),
            timing,
        )
        logprobs, _, values, bootstrap_value = jax.device_get(
            forward(network, params, rollout, False)
        )
        np.testing.assert_allclose(logprobs, rollout["logprobs"], atol=1e-5, err_msg=f"rollout {k}")
        np.testing.assert_allclose(values, rollout["values"], atol=1e-5, err_msg=f"rollout {k}")
        if previous is not None:  # the value after the last step is the next rollout's first
            np.testing.assert_allclose(
                previous, rollout["values"][0], atol=1e-5, err_msg=f"rollout {k}"
            )
        previous = bootstrap_value
        np.testing.assert_array_equal(
            rollout["first"][1:], 1.0 - rollout["valid"][:-1]
        )  # after a reset step
        starts += int(rollout["first"][1:].sum())
    envs.close()
    assert starts > 4  # episodes ended inside rollouts


def test_recurrent_minibatches_are_whole_env_sequences_with_their_states():
    ppo = load_script("ppo_sync_baseline.py")
    T, B, M = 6, 8, 4
    rng = np.random.default_rng(0)
    data = {
        "obs": {"a": rng.normal(size=(T, B, 3)), "b": rng.integers(0, 9, (T, B))},
        "valid": rng.random((T, B)),
        "first": rng.random((T, B)) < 0.2,
        "state": (rng.normal(size=(B, 5)), rng.normal(size=(B, 5))),
    }
    data = jax.tree.map(
        lambda x: x.astype(np.float32) if x.dtype == np.float64 else x, data
    )  # as JAX holds them
    mbs = jax.device_get(ppo.minibatches(jax.random.PRNGKey(3), data, M))
    assert mbs["valid"].shape == (M, T, B // M) and mbs["obs"]["a"].shape == (M, T, B // M, 3)
    assert mbs["state"][0].shape == (M, B // M, 5)
    seen = []
    for m in range(M):
        for j in range(B // M):
            # The env whose whole sequence this is: found by its state, then every field matches.
            b = int(np.flatnonzero((data["state"][0] == mbs["state"][0][m, j]).all(1))[0])
            seen.append(b)
            np.testing.assert_array_equal(mbs["state"][1][m, j], data["state"][1][b])
            for name, x in [
                ("valid", data["valid"]),
                ("first", data["first"]),
                ("b", data["obs"]["b"]),
            ]:
                y = mbs["obs"]["b"] if name == "b" else mbs[name]
                np.testing.assert_array_equal(y[m, :, j], x[:, b], err_msg=name)
            np.testing.assert_array_equal(mbs["obs"]["a"][m, :, j], data["obs"]["a"][:, b])
    assert sorted(seen) == list(range(B))  # every env exactly once
    assert seen != list(range(B))  # shuffled


@pytest.mark.timeout(600)
def test_lstm_run_saves_resumes_and_evaluates(script, tmp_path, capsys):
    """A tiny --lstm run with a video logs every update tag; --resume continues it with the LSTM (the flag read from the
    checkpoint); utils/evaluate.py scores the checkpoint with no --lstm flag of its own."""
    run_dir = tmp_path / "run"
    assert (
        run_main(
            script,
            cli(
                script,
                run_dir=run_dir,
                lstm=True,
                lstm_size=16,
                eval_episodes=2,
                capture_video=True,
            ),
        )
        == 0
    )
    assert len(list((run_dir / "videos").glob("*.mp4"))) == 1
    config = json.loads((run_dir / "config.json").read_text())
    assert config["lstm"] is True and config["lstm_size"] == 16
    budget = int(config["total_timesteps"])
    check_run_files(script, run_dir, "CartPole-v1", budget)  # every update tag, as a smoke run's
    assert run_main(script, ["--resume", run_dir, "--total-timesteps", 2 * budget]) == 0
    steps = [r["step"] for r in read_metrics(run_dir) if r["tag"] == "losses/loss"]
    assert max(steps) == 2 * budget, steps
    code, _, err = evaluate_here([run_dir, "--episodes", 3], capsys)  # its command line, in-process
    assert code == 0, err
    scores = json.loads((run_dir / "eval.json").read_text())
    assert scores["episodes"] == 3 and all(r > 0 for r in scores["scores"]), scores


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("env_id", "episodes"), [("CartPole-v1", 6), ("Breakout-v5", 1)])
def test_evaluation_starts_from_zeros_and_resets_where_episodes_start(
    env_id, episodes, monkeypatch
):
    """The library's evaluate() gives every env a zero state at the start and `first` exactly
    after an episode's end (envpool's reset step), as the actors do; on Atari also after each life
    lost, where training's episodic life ends an episode."""
    appo = load_script("appo_envpool.py")
    args = appo.resolve_args(appo.Args(env_id=env_id, lstm=True, lstm_size=LSTM_SIZE))
    network, _, continuous, normalizer, state = appo.build(args, jax.random.PRNGKey(0))
    seen, ends = [], []  # the `core` of every call; what each step ended (episode, or a life)

    class Probe:  # the network, recording the `core` of every call
        lstm_size, heads, action_mask = network.lstm_size, network.heads, network.action_mask

        @staticmethod
        def apply(params, obs, core):
            jax.debug.callback(
                lambda s, f: seen.append((np.asarray(s).copy(), np.asarray(f).copy())),
                core[0][1],
                core[1],
            )
            return network.apply(params, obs, core)

    make_env = tasks.make_env

    class Recorded:
        def __init__(self, envs):
            self.envs, self.lives = envs, None

        def __getattr__(self, name):
            return getattr(self.envs, name)

        def reset(self):
            obs, info = self.envs.reset()
            self.lives = info.get("lives")
            return obs, info

        def step(self, action):
            out = self.envs.step(action)
            lives = out[4].get("lives")
            ends.append(out[2] | out[3] | (lives < self.lives if lives is not None else False))
            self.lives = lives
            return out

    monkeypatch.setattr(evaluation, "make_env", lambda *a, **k: Recorded(make_env(*a, **k)))
    policy = appo.make_policy_step(Probe, continuous, values=False)
    scores = evaluation.evaluate(
        policy,
        state["params"],
        lambda n: appo.zero_core(network.lstm_size, n),
        args,
        normalizer,
        episodes,
    )
    assert len(scores) == episodes
    assert not seen[0][0].any() and seen[0][1].all()  # zeros, every env starting
    # Call t acts on the observation of step t - 1; envpool's step after an episode's end (the
    # terminal observation came with done, from step t - 2) returns the next episode's first.
    assert not seen[1][1].any()
    for t in range(2, len(seen)):
        np.testing.assert_array_equal(seen[t][1], ends[t - 2], err_msg=f"call {t}")
    assert (
        sum(e.sum() for e in ends[:-2]) >= 3
    )  # episodes (or lives) ended where the check above looks


@pytest.mark.timeout(300)
def test_lstm_with_box_actions_and_a_preset_of_many_minibatches(tmp_path):
    """HalfCheetah's preset has 32 minibatches; with --lstm and 4 envs they become 4 (whole env
    sequences), and Gaussian actions [T, B, A] go through the recurrent update."""
    appo = load_script("appo_envpool.py")
    assert appo.resolve_args(appo.Args(env_id="HalfCheetah-v4", lstm=True)).num_minibatches == 8
    assert (
        appo.resolve_args(appo.Args(env_id="HalfCheetah-v4")).num_minibatches == 32
    )  # unchanged without
    run_dir = tmp_path / "run"
    flags = dict(run_dir=run_dir, lstm=True, num_minibatches=None, update_epochs=None)
    assert (
        run_main("appo_envpool.py", cli("appo_envpool.py", env_id="HalfCheetah-v4", **flags)) == 0
    )
    config = json.loads((run_dir / "config.json").read_text())
    assert config["num_minibatches"] == 4 and config["update_epochs"] == 10
    assert len(tag_values(read_metrics(run_dir), "losses/loss")) == 2


# ---------------------------------------------------------------------------------------------
# A memory task: CartPole-v1 without its velocities
# ---------------------------------------------------------------------------------------------


class HideVelocities:
    """An envpool CartPole whose observations have the cart's and the pole's velocities (entries
    1 and 3) zeroed: a feed-forward policy sees positions only, so it must guess the motion; a
    recurrent one can infer it from successive positions (rl-baselines3-zoo's CartPoleNoVel-v1)."""

    def __init__(self, envs):
        self.envs = envs

    def __getattr__(self, name):
        return getattr(self.envs, name)

    @staticmethod
    def hide(obs):
        obs = obs.copy()
        obs[..., [1, 3]] = 0.0
        return obs

    def reset(self, *args, **kwargs):
        obs, info = self.envs.reset(*args, **kwargs)
        return self.hide(obs), info

    def step(self, *args, **kwargs):
        obs, *rest = self.envs.step(*args, **kwargs)
        return self.hide(obs), *rest

    def recv(self, *args, **kwargs):
        obs, *rest = self.envs.recv(*args, **kwargs)
        return self.hide(obs), *rest


# The CartPole preset (rl-baselines3-zoo's PPO, which its recurrentppo.yml also uses for
# CartPoleNoVel-v1: 8 envs x 32 steps, 20 epochs, lambda 0.8), with that file's LSTM of 64 units,
# measured over 200k steps. APPO runs V-trace at the preset's lambda (rlax's lambda_). With lambda 1
# (the paper's V-trace, which APPO used before) it did not learn this task in 200k steps, nor did
# the sync baseline with lambda 1 (best 20-episode mean 206, seed 1), which is why this test used to
# run APPO with --no-vtrace; with 0.8 both learn it. The default 128 units learn it too, more
# slowly (sync seed 2: 325 at 200k, 400 at 300k). Measured on a quiet 2-core machine (best
# 20-episode mean, wall time): --lstm, sync 500 / 500 (seeds 1, 2; 37 s), APPO --no-vtrace 500 /
# 500 (47 s); feed-forward, sync 59 / 62 (19 s), APPO 59 / 59 (29 s). APPO with V-trace at
# lambda 0.8: seeds 1 and 2 pass, 2 minutes for its 3 runs beside a sweep of 2 runs. The suite runs
# seed 1 (seed 2 of both scripts took 160 s more of it), at 150k steps: its first 20-episode mean of
# 400 came at 68.1k (sync) and 93.4k (APPO), both then 500 (2026-12-05).
MEMORY_BUDGET = 150_000
MEMORY_FLAGS = {"ppo_sync_baseline.py": dict(lstm_size=64), "appo_envpool.py": dict(lstm_size=64)}


# The feed-forward control shows that the task needs memory, whichever script learns it: run once,
# with the sync baseline.
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "script_name, lstm",
    [("ppo_sync_baseline.py", True), ("appo_envpool.py", True), ("ppo_sync_baseline.py", False)],
)
def test_lstm_learns_cartpole_without_velocities(script_name, lstm, tmp_path, monkeypatch):
    """With --lstm some 20 consecutive episodes average at least 400 within the budget; the
    feed-forward policy on the same task and budget stays below 150 (CartPole with velocities:
    500)."""
    module = load_script(script_name)
    make_env = tasks.make_env
    monkeypatch.setattr(
        tasks, "make_env", lambda *args, **kwargs: HideVelocities(make_env(*args, **kwargs))
    )
    run_dir = tmp_path / "run"
    args = dataclasses.replace(
        module.Args(),
        env_id="CartPole-v1",
        seed=1,
        total_timesteps=MEMORY_BUDGET,
        lstm=lstm,
        eval_episodes=0,
        run_dir=str(run_dir),
        **MEMORY_FLAGS[script_name],
    )
    assert module.main(args) == 0
    returns = tag_values(read_metrics(run_dir), "charts/episodic_return")
    windows = np.convolve(returns, np.ones(20) / 20, "valid")
    curve = json.dumps([round(float(w)) for w in windows[:: max(1, len(windows) // 40)]])
    if lstm:
        assert windows.max() >= 400, (
            f"best 20-episode mean {windows.max():.1f}; means along the run: {curve}"
        )
    else:
        assert windows.max() < 150, (
            f"feed-forward reached {windows.max():.1f}; means along the run: {curve}"
        )


# APPO --lstm on CartPole-v1 at default flags (V-trace, the CartPole preset, 128 units), 500k
# steps: the learning-parity issue saw one such run fall to 9 from 350k steps. With V-trace's rho
# in the advantage as well as PPO's ratio (a sample weighted rho^2 where pi < mu; see
# docs/DESIGN.md), 2 of 10 runs ended inside a dip (471.9 and 459), the KL of pi from mu in the
# update was 0.13-0.15 (sync 0.03-0.04). With one weight (2026-12-04, seeds 1-6 at default flags,
# beside a sync run): all 6 ended at 500, first at 475 at 80k +- 19k steps (sync: 56k +- 20k);
# they still dip after it, as sync's do (lowest 20-episode mean 10-109; sync 9-132); KL in the
# update 0.06-0.08. The test asserts the criterion: a 20-episode mean of 475 at the end.
# It runs --deterministic (the actor at lag 1, as the free-running default): a free-running run's
# end depends on the machine's timing, and one of seed 2 ended inside a dip (470.6) on a busy
# machine; this one is the same run each time on a machine (seed 1 at 500k: 500.0, lowest
# 20-episode mean after the first 475: 98). The suite runs it at 150k (the rate annealed to 0 by
# then; seed 1: lowest 20-episode mean after its first 475 250, the end 500.0; at 300k, which the
# suite ran before, the end was 500.0 too), for time: 47 s alone; 300k took 126 s in the suite.
APPO_LSTM_BUDGET = 150_000


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_appo_lstm_learns_cartpole_and_stays(tmp_path):
    module = load_script("appo_envpool.py")
    args = module.Args(
        env_id="CartPole-v1",
        seed=1,
        lstm=True,
        total_timesteps=APPO_LSTM_BUDGET,
        eval_episodes=0,
        deterministic=True,
        actor_lag=1,
        run_dir=str(tmp_path / "run"),
    )
    assert module.main(args) == 0
    returns = tag_values(read_metrics(tmp_path / "run"), "charts/episodic_return")
    windows = np.convolve(returns, np.ones(20) / 20, "valid")
    curve = json.dumps([round(float(w)) for w in windows[:: max(1, len(windows) // 40)]])
    assert windows[-1] >= 475, f"last 20: {windows[-1]:.1f}; along the run: {curve}"
