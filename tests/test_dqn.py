"""dqn_envpool.py: its math against plain loops of the papers' formulas, its rounds (the replay
ratio held, async and serial), resume, bad input, and learning CartPole in both modes."""

import json
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (count_complete_lines, load_script, read_checkpoint, read_metrics, run_main, run_script,
                     sigterm_when, tag_steps, tag_values)

from jax_async_rl import devices

SCRIPT = "dqn_envpool.py"
dqn = load_script(SCRIPT)

# 2 rounds of 4 envs x 16 steps after a first round without updates; 4 gradient steps of 32 a round.
TINY = dict(num_envs=4, num_steps=16, total_timesteps=192, learning_starts=64, buffer_size=1000, batch_size=32,
            replay_ratio=2.0, eval_episodes=0, log_frequency=1)


def argv(env_id="CartPole-v1", **flags):
    return ["--env-id", env_id, *argv_of({**TINY, **flags})]


def argv_of(flags: dict) -> list:
    out = []
    for name, value in flags.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool) and getattr(dqn.Args, name) is not None:  # a switch; a preset's takes a value
            out.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None:
            out += [f"--{flag}", str(value)]
    return out


# ------------------------------------------------------------------------------------------------
# Math
# ------------------------------------------------------------------------------------------------


def test_dqn_and_double_dqn_targets_against_a_loop():
    rng = np.random.default_rng(0)
    B, A = 9, 4
    next_target, next_online = rng.normal(size=(2, B, A)).astype(np.float32)
    reward = rng.normal(size=B).astype(np.float32)
    discount = np.where(rng.random(B) < 0.3, 0.0, 0.99 ** rng.integers(1, 4, B)).astype(np.float32)
    for double in (False, True):
        got = np.asarray(dqn.q_targets(next_target, next_online, reward, discount, double))
        for i in range(B):
            # Mnih et al. 2015: max_a Q_target(s', a); van Hasselt et al. 2016: Q_target(s', argmax_a Q_online(s', a)).
            a = int(np.argmax(next_online[i])) if double else int(np.argmax(next_target[i]))
            assert got[i] == pytest.approx(reward[i] + discount[i] * next_target[i, a], rel=1e-6)
    plain = np.asarray(dqn.q_targets(next_target, next_online, reward, discount, False))
    double = np.asarray(dqn.q_targets(next_target, next_online, reward, discount, True))
    assert not np.allclose(plain, double)  # the case tells the two apart


def bellemare_projection(p, r, gamma, z):
    """Bellemare et al. 2017, Algorithm 1, one transition at a time."""
    v_min, v_max, n = z[0], z[-1], len(z)
    dz = (v_max - v_min) / (n - 1)
    m = np.zeros(n)
    for j in range(n):
        tz = min(max(r + gamma * z[j], v_min), v_max)
        b = (tz - v_min) / dz
        lo, up = int(np.floor(b)), int(np.ceil(b))
        if lo == up:
            m[lo] += p[j]
        else:
            m[lo] += p[j] * (up - b)
            m[up] += p[j] * (b - lo)
    return m


def test_c51_projection_against_bellemare_algorithm_1():
    rng = np.random.default_rng(1)
    z = np.linspace(-10.0, 10.0, 51)
    B = 12
    probs = rng.dirichlet(np.ones(51), size=B)
    reward = rng.normal(scale=4.0, size=B)
    reward[:3] = [0.0, 25.0, -30.0]  # onto the atoms exactly; clipped at both ends
    discount = np.full(B, 0.99)
    discount[0], discount[4] = 1.0, 0.0  # every atom onto an atom; a termination (all mass at r)
    got = np.asarray(dqn.c51_project(jnp.asarray(probs, jnp.float32), jnp.asarray(reward, jnp.float32),
                                     jnp.asarray(discount, jnp.float32), jnp.asarray(z, jnp.float32)))
    for i in range(B):
        np.testing.assert_allclose(got[i], bellemare_projection(probs[i], reward[i], discount[i], z), atol=2e-6)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=1e-5)  # no mass lost


@pytest.mark.parametrize("huber_delta", [0.0, 1.0])
def test_losses_and_priorities(huber_delta):
    """The squared error (--huber-delta 0) or Huber on the target for DQN; C51's cross-entropy to
    the projected target; TD errors for the priorities."""
    rng = np.random.default_rng(2)
    obs_space = np.zeros((1, 3), np.float32)
    batch = dict(obs=rng.normal(size=(6, 3)).astype(np.float32), next_obs=rng.normal(size=(6, 3)).astype(np.float32),
                 action=rng.integers(0, 2, 6), reward=rng.normal(size=6).astype(np.float32) * 3,
                 discount=np.full(6, 0.9, np.float32), weights=rng.random(6).astype(np.float32))
    support = jnp.linspace(-10.0, 10.0, 11)
    for c51 in (False, True):
        net = dqn.QNetwork(2, (("flat", 1.0),), dueling=True, num_atoms=11 if c51 else 0)
        params = net.init(jax.random.PRNGKey(0), obs_space)
        target = net.init(jax.random.PRNGKey(1), obs_space)
        args = dqn.Args(double_dqn=True, c51=c51, huber_delta=huber_delta)
        loss, (errors, q_taken) = dqn.dqn_loss(params, target, net, batch, args, support)
        q, nt, no = (np.asarray(net.apply(p, batch[k])) for p, k in [(params, "obs"), (target, "next_obs"),
                                                                      (params, "next_obs")])
        a = batch["action"]
        if c51:
            soft = lambda x: np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)
            best = np.argmax((soft(no) * np.asarray(support)).sum(-1), axis=1)
            m = np.stack([bellemare_projection(soft(nt[i, best[i]]), batch["reward"][i], 0.9, np.asarray(support))
                          for i in range(6)])
            logp = np.log(soft(q[np.arange(6), a]))
            ce = -(m * logp).sum(-1)
            np.testing.assert_allclose(errors, ce, rtol=1e-4)
            assert float(loss) == pytest.approx(np.mean(batch["weights"] * ce), rel=1e-4)
        else:
            y = batch["reward"] + 0.9 * nt[np.arange(6), np.argmax(no, axis=1)]
            d = q[np.arange(6), a] - y
            assert np.abs(d).max() > 1  # both branches of Huber are exercised
            per = (np.where(np.abs(d) <= 1, 0.5 * d**2, np.abs(d) - 0.5) if huber_delta else 0.5 * d**2)
            np.testing.assert_allclose(errors, d, rtol=1e-5, atol=1e-6)
            assert float(loss) == pytest.approx(np.mean(batch["weights"] * per), rel=1e-5)


def test_dueling_head_and_exploration_schedules():
    net = dqn.QNetwork(3, (("flat", 1.0),), dueling=True)
    params = net.init(jax.random.PRNGKey(0), np.zeros((1, 4), np.float32))
    assert params["params"]["Dense_3"]["kernel"].shape == (256, 1)  # the value stream
    # Ape-X (Horgan et al. 2018): eps_i = 0.4 ^ (1 + 7 i / (N - 1)).
    eps = dqn.apex_epsilons(8, 0.4, 7.0)
    np.testing.assert_allclose(eps, [0.4 ** (1 + 7 * i / 7) for i in range(8)])
    assert dqn.apex_epsilons(1, 0.4, 7.0)[0] == pytest.approx(0.4)
    # CleanRL's linear schedule.
    assert [dqn.linear_schedule(1.0, 0.05, 100, t) for t in (0, 50, 100, 1000)] == pytest.approx([1.0, 0.525, 0.05, 0.05])


# ------------------------------------------------------------------------------------------------
# Runs
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("serial", [False, True])
def test_rounds_hold_the_replay_ratio_and_log(serial, tmp_path, capsys):
    code, out, err = run_main(SCRIPT, argv(run_dir=tmp_path / "r", serial=serial, double_dqn=True, n_step=3,
                                           prioritized_replay=True), capsys)
    assert code == 0, err
    records = read_metrics(tmp_path / "r")
    assert tag_values(records, "replay/ratio") == [2.0, 2.0]
    assert tag_steps(records, "losses/loss") == [128, 192]  # the first round (64 steps) only fills the buffer
    lags = tag_values(records, "async/policy_lag_mean")
    assert len(lags) == 3 and (serial and lags == [0, 0, 0] or not serial and min(lags) >= 0)
    assert tag_values(records, "replay/fill")[-1] == pytest.approx(192 / 1000, abs=0.05)
    assert "4 gradient steps a round" in out and ("serial" in out) == serial
    state = read_checkpoint(tmp_path / "r")["state"]
    assert int(state["global_step"]) == 192 and int(state["policy_version"]) == 3
    # No multiple of 500 env steps was crossed, so the target was never synced: the online one moved on.
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
    assert not np.array_equal(flat(state["params"]), flat(state["target_params"]))


def test_atari_rainbow_preset_with_frame_storage(tmp_path, capsys):
    """Pong at its preset (C51, dueling, double, 3-step, prioritised) for two small rounds."""
    code, out, err = run_main(SCRIPT, argv("Pong-v5", run_dir=tmp_path / "p", num_envs=4, num_steps=8,
                                           total_timesteps=96, learning_starts=32, batch_size=8, replay_ratio=1.0), capsys)
    assert code == 0, err
    config = json.loads((tmp_path / "p" / "config.json").read_text())
    assert all(config[k] for k in ("c51", "dueling", "double_dqn", "prioritized_replay")) and config["n_step"] == 3
    assert config["num_splits"] == 2 and config["learning_rate"] == 6.25e-5
    assert len(tag_values(read_metrics(tmp_path / "p"), "losses/loss")) == 2


def test_resume_restores_targets_optimiser_and_epsilon(tmp_path, capsys):
    run = tmp_path / "r"
    assert run_main(SCRIPT, argv(run_dir=run, target_network_frequency=64, exploration_fraction=1.0, end_e=0.05),
                    capsys)[0] == 0
    before = read_checkpoint(run)["state"]
    # The resumed run refills its buffer for --learning-starts first: 128 of the 128 steps left would
    # leave no gradient step, which is refused before anything starts.
    code, _, err = run_main(SCRIPT, ["--resume", run, "--total-timesteps", 320, "--learning-starts", 128], capsys)
    assert code == 2 and "--learning-starts 128" in err and len(err.strip().splitlines()) == 1, err
    assert read_checkpoint(run)["state"]["global_step"] == before["global_step"]
    # 64: the round at 256 refills, the one at 320 learns (its target synced first, every 64 steps).
    code, _, err = run_main(SCRIPT, ["--resume", run, "--total-timesteps", 320, "--learning-starts", 64], capsys)
    assert code == 0, err
    records = read_metrics(run)
    assert tag_steps(records, "losses/loss") == [128, 192, 320]
    # ε follows the restored step count (a schedule begun again would be at 1 - 0.95 x 64 / 320).
    eps = dict(zip(tag_steps(records, "charts/epsilon"), tag_values(records, "charts/epsilon")))
    assert eps[256] == pytest.approx(1.0 - 0.95 * 256 / 320)
    after = read_checkpoint(run)["state"]
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
    # The parameters came back bit for bit (the target synced to them), and Adam's step count went on.
    assert np.array_equal(flat(before["params"]), flat(after["target_params"]))
    counts = lambda tree: [int(v) for k, v in jax.tree_util.tree_leaves_with_path(tree) if "count" in str(k[-1])]
    assert counts(after["opt_state"]) == [c + 4 for c in counts(before["opt_state"])] and counts(before["opt_state"])
    assert int(after["global_step"]) == 320 and int(after["policy_version"]) == 5


@pytest.mark.timeout(300)
def test_it_learns_the_optimal_values_of_a_chain(tmp_path, capsys):
    """End to end, actors, replay and learner together: a chain of 5 cells (tests/user_envs.py),
    a game truncated after 10 steps, explored at random (ε = 1): Q-learning's fixed point is Q*,
    whatever the behaviour. Every learned value within 0.03 of Q* (γ = 0.9); a truncation taken
    as an end, a reward or an action a row off, or a stale target would miss it. utils/evaluate.py
    then plays the checkpoint."""
    run, gamma = tmp_path / "r", 0.9
    flags = dict(total_timesteps=8000, learning_starts=500, buffer_size=5000, replay_ratio=4.0, batch_size=32,
                 num_steps=8, learning_rate=1e-3, target_network_frequency=256, start_e=1.0, end_e=1.0, gamma=gamma)
    code, _, err = run_main(SCRIPT, argv("tests.user_envs:Chain", run_dir=run, **flags), capsys)
    assert code == 0, err
    args = dqn.resolve_args(dqn.Args(env_id="tests.user_envs:Chain", **{**TINY, **flags}))
    network = dqn.build(args, jax.random.PRNGKey(0))[0]
    q = np.asarray(network.apply(read_checkpoint(run)["state"]["params"], np.eye(5, dtype=np.float32)))[:4]
    cells = np.arange(4)
    right = gamma ** (3 - cells)
    left = gamma * gamma ** (3 - np.maximum(cells - 1, 0))
    np.testing.assert_allclose(q, np.stack([left, right], 1), atol=0.03)
    # utils/evaluate.py plays the checkpoint with the script's evaluation policy: straight right, 1 a game.
    result = run_script("utils/evaluate.py", [run, "--episodes", 4, "--trust-env-module"], timeout=300)
    assert result.returncode == 0, result.stderr
    assert "4 episodes with the run's own evaluation policy, ε-greedy at ε 0.001" in result.stdout, result.stdout
    assert json.loads((run / "eval.json").read_text())["scores"] == [1.0] * 4


@pytest.mark.timeout(300)
def test_sigterm_stops_with_a_checkpoint_and_resume_finishes(tmp_path):
    """SIGTERM in the middle of learning (async): exit 143 within seconds, no traceback, the
    newest round checkpointed; --resume then trains to the budget."""
    run, total = tmp_path / "r", 64 * 200
    code, seconds, err = sigterm_when(SCRIPT, argv(run_dir=run, total_timesteps=total, save_interval=1000),
                                      tmp_path / "logs", lambda: count_complete_lines(run / "metrics.jsonl",
                                                                                      '"losses/loss"') >= 3, 240)
    assert code == 128 + signal.SIGTERM and seconds < 20 and "Traceback" not in err, err[-3000:]
    step = int(read_checkpoint(run)["state"]["global_step"])
    assert 3 * 64 <= step < total and step == max(tag_steps(read_metrics(run), "losses/loss"))
    code = run_main(SCRIPT, ["--resume", run, "--total-timesteps", step + 4 * 64, "--learning-starts", 64])
    assert code == 0 and int(read_checkpoint(run)["state"]["global_step"]) == step + 4 * 64


@pytest.mark.parametrize("flags, fragments", [
    (dict(replay_ratio=1.7), ["--replay-ratio", "whole number"]),
    (dict(distributed=True), ["--distributed"]),
    (dict(buffer_size=64), ["--buffer-size"]),
    (dict(num_splits=3), ["--num-splits", "--num-envs"]),
    (dict(c51=True, v_min=5.0, v_max=5.0), ["--v-min", "--v-max"]),
    # Absurd values, once tracebacks (an overflow, a 1.86 TiB allocation at the first update):
    (dict(replay_ratio=1e308), ["--replay-ratio", "at most"]),
    (dict(replay_ratio=1e9), ["--replay-ratio", "at most"]),
    (dict(priority_alpha=1000.0), ["--priority-alpha", "[0, 1]"]),
    (dict(buffer_size=10_000_000_000), ["--buffer-size", "at most 2,147,483,647"]),
    (dict(buffer_size=1_000_000_000), ["--buffer-size 1,000,000,000", "GiB", "of the 16.0 GiB"]),  # 31 bytes a row
    (dict(total_timesteps=2**31), ["--total-timesteps", "32-bit"]),
    (dict(learning_starts=192), ["--learning-starts 192", "no gradient step"]),  # the whole budget
])
def test_bad_input_gets_one_line_and_exit_2(flags, fragments, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(devices, "available_memory", lambda: 16 * 2**30)  # this machine's, whatever it has
    code, _, err = run_main(SCRIPT, argv(run_dir=tmp_path / "r", **flags), capsys)
    assert code == 2 and all(f in err for f in fragments) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()


def test_continuous_actions_are_refused_naming_sac(tmp_path, capsys):
    code, _, err = run_main(SCRIPT, argv("Pendulum-v1", run_dir=tmp_path / "r"), capsys)
    assert code == 2 and "sac_envpool.py" in err and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------------------------------------
# Learning
# ------------------------------------------------------------------------------------------------

# The CartPole preset, 2 seeds a mode (README, DQN): the first 20-episode mean of 475 at 31.7k and
# 34.8k steps serial, 34.6k and 42.5k async. DQN's return falls back after its peak on CartPole
# (the known instability): the test asks for the peak, not the end.
CARTPOLE_BUDGET = 60_000


@pytest.mark.slow
@pytest.mark.parametrize("serial", [False, True])
def test_learns_cartpole_async_and_serial(serial, tmp_path, capsys):
    code, _, err = run_main(SCRIPT, ["--env-id", "CartPole-v1", "--run-dir", tmp_path / "r", "--total-timesteps",
                                     CARTPOLE_BUDGET, "--eval-episodes", 0, *(["--serial"] if serial else [])], capsys)
    assert code == 0, err
    records = read_metrics(tmp_path / "r")
    returns = tag_values(records, "charts/episodic_return")
    best = np.convolve(returns, np.ones(20) / 20, "valid").max()
    assert best >= 475, f"best 20-episode mean {best:.1f}"
    assert tag_values(records, "replay/ratio")[-1] == pytest.approx(32.0, rel=0.05)


# The classic preset (CleanRL's dqn.py) on CartPole-v1 at CleanRL's 60k-step schedule, 8 envs x 5 steps
# asynchronously (the project's way; measured: the last 20 episodes 410-500 in 4 runs, mean Q 64-75 at
# most). With the Huber loss it diverged: mean Q in the thousands, the return 10 (a policy that pushes
# one way). Q can never exceed 1 / (1 - gamma) = 100 on CartPole.
@pytest.mark.slow
def test_the_classic_preset_learns_cartpole_with_bounded_values(tmp_path, capsys):
    classic = {**dqn.PRESETS["classic"], "num_envs": 8, "num_steps": 5, "total_timesteps": 60_000, "eval_episodes": 0,
               "seed": 1}
    code, _, err = run_main(SCRIPT, [*argv_of(classic), "--env-id", "CartPole-v1", "--run-dir", tmp_path / "r"], capsys)
    assert code == 0, err
    records = read_metrics(tmp_path / "r")
    q = tag_values(records, "losses/q_values")
    assert max(q) < 1 / (1 - classic["gamma"]), f"mean Q of a batch reached {max(q):.1f}"
    last = np.mean(tag_values(records, "charts/episodic_return")[-20:])
    assert last >= 300, f"last 20-episode mean {last:.1f}"
