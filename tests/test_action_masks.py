"""Legal actions (an observation's "action_mask") and multi-discrete actions: the masked and the
factored categorical of the PPO family against numpy, their sampling frequencies, the learner's
recomputation with the stored masks, and DQN's ε-greedy, greedy action and target maximum over
legal actions. (Which tasks get which policy, and the env's actions: tests/test_lib_tasks.py.)"""

import queue
import re

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from helpers import load_script, read_metrics, run_main
from jax_async_rl import evaluation, gym_pool, tasks, threads
from jax_async_rl.replay import Collecting
from jax_async_rl.flags import UsageError

ppo = load_script(
    "ppo_sync_baseline.py"
)  # the PPO family's math is the same text (test_scripts.SAME_TEXT)
dqn = load_script("dqn_envpool.py")
DRAWS = 100_000


def softmax_over(logits, legal):
    """float64 probabilities of a categorical over the legal entries of each row (numpy)."""
    x = np.where(legal, np.asarray(logits, np.float64), -np.inf)
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


def random_legal_rows(rng, shape):
    """A random mask of `shape` (int8, as envpool's), at least one legal entry in each row."""
    legal = (rng.random(shape) < 0.5).astype(np.int8)
    rows = legal.reshape(-1, shape[-1])
    rows[np.arange(len(rows)), rng.integers(0, shape[-1], len(rows))] = 1
    return legal


# ---------------------------------------------------------------------------------------------
# The masked categorical (ppo_sync_baseline.py and the PPO family)
# ---------------------------------------------------------------------------------------------


def test_masked_log_prob_and_entropy_against_numpy():
    rng = np.random.default_rng(0)
    B, A = 64, 7
    logits = rng.normal(scale=2.0, size=(B, A)).astype(np.float32)
    legal = random_legal_rows(rng, (B, A))
    logits[0] = np.where(
        legal[0], logits[0], 80.0
    )  # an illegal action the network likes most: no probability
    actions = np.array([rng.choice(np.flatnonzero(row)) for row in legal])
    logprob, entropy = ppo.log_prob_entropy(
        jnp.asarray(logits), jnp.asarray(actions), False, jnp.asarray(legal)
    )
    p = softmax_over(logits, legal > 0)
    np.testing.assert_allclose(
        np.asarray(logprob), np.log(p[np.arange(B), actions]), rtol=1e-5, atol=1e-5
    )
    want_entropy = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=1)
    np.testing.assert_allclose(np.asarray(entropy), want_entropy, rtol=1e-5, atol=1e-5)
    # One legal action: certain, no entropy; none legal (an episode's last observation): finite.
    one = np.eye(A, dtype=np.int8)[[3]]
    logprob, entropy = ppo.log_prob_entropy(
        jnp.asarray(logits[:1]), jnp.array([3]), False, jnp.asarray(one)
    )
    assert float(logprob[0]) == 0.0 and float(entropy[0]) == 0.0
    logprob, entropy = ppo.log_prob_entropy(
        jnp.asarray(logits[:1]), jnp.array([3]), False, jnp.zeros((1, A), jnp.int8)
    )
    assert np.isfinite(float(logprob[0])) and np.isfinite(float(entropy[0]))
    # No mask: the categorical of before, bit for bit.
    plain = ppo.log_prob_entropy(jnp.asarray(logits), jnp.asarray(actions), False)
    ones = ppo.log_prob_entropy(
        jnp.asarray(logits), jnp.asarray(actions), False, jnp.ones((B, A), jnp.int8)
    )
    np.testing.assert_allclose(np.asarray(plain), np.asarray(ones), rtol=1e-6, atol=1e-6)


def test_masked_gradients_do_not_reach_illegal_logits():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(4, 5)).astype(np.float32))
    legal = jnp.asarray(random_legal_rows(rng, (4, 5)))
    actions = jnp.asarray([int(np.flatnonzero(row)[0]) for row in np.asarray(legal)])

    def objective(x):
        logprob, entropy = ppo.log_prob_entropy(x, actions, False, legal)
        return jnp.sum(logprob + 0.1 * entropy)

    grads = np.asarray(jax.grad(objective)(logits))
    assert np.all(np.isfinite(grads)) and np.all(grads[np.asarray(legal) == 0] == 0.0)


def chi_square_p(samples, probs):
    """p-value of Pearson's χ² test of `samples` (ints) against `probs` over its nonzero entries."""
    support = np.flatnonzero(probs)
    counts = np.bincount(samples, minlength=len(probs))[support]
    return stats.chisquare(counts, probs[support] * len(samples)).pvalue


def test_masked_sampling_frequencies_and_no_illegal_draw():
    """10^5 draws of one categorical with three of eight actions illegal, one of them with the
    largest logit: none is drawn, and the others' frequencies pass χ² (fixed key: deterministic)."""
    logits = np.array([0.3, 5.0, -1.0, 0.0, 1.2, 6.0, -0.4, 0.9], np.float32)
    legal = np.array([1, 0, 1, 1, 1, 0, 0, 1], np.int8)
    samples = np.asarray(
        ppo.sample_action(
            jnp.tile(logits, (DRAWS, 1)),
            jax.random.split(jax.random.PRNGKey(3), DRAWS),
            False,
            False,
            jnp.tile(legal, (DRAWS, 1)),
        )
    )
    assert samples.shape == (DRAWS,) and np.all(legal[samples] == 1)
    assert chi_square_p(samples, softmax_over(logits, legal > 0)) > 1e-3
    greedy = ppo.sample_action(
        jnp.asarray(logits[None]), None, False, True, jnp.asarray(legal[None])
    )
    assert int(greedy[0]) == 4  # the best legal action, not action 5


def test_factored_categorical_is_the_sum_over_dimensions():
    """A factored policy over D = 3 dimensions of 6, 1 and 3 choices (RubiksCube's), with a mask of
    one row a dimension: its log-probability and entropy are the sums of the dimensions' (numpy);
    10^5 draws never take an illegal value nor one past a dimension's choices, and each dimension's
    frequencies pass χ²."""
    rng = np.random.default_rng(2)
    heads, B = (6, 1, 3), 16
    network = ppo.ActorCritic(18, False, (("flat", 1.0),), 0, heads, True)
    logits = rng.normal(scale=1.5, size=(B, 18)).astype(np.float32)
    mask = random_legal_rows(rng, (B, 3, 6))
    legal = np.array(ppo.legal_actions(network, {"action_mask": mask}, jnp.asarray(logits)))
    choices = np.arange(6) < np.array(heads)[:, None]
    np.testing.assert_array_equal(legal > 0, (mask > 0) & choices)
    legal[:, 1, 0] = legal[:, 2, 0] = 1  # (each dimension keeps a legal value)
    actions = np.stack([[rng.choice(np.flatnonzero(row)) for row in legal[b]] for b in range(B)])
    logprob, entropy = ppo.log_prob_entropy(
        jnp.asarray(logits), jnp.asarray(actions), False, jnp.asarray(legal)
    )
    assert logprob.shape == entropy.shape == (B,)
    per_dim = [softmax_over(logits.reshape(B, 3, 6)[:, d], legal[:, d] > 0) for d in range(3)]
    want = sum(np.log(per_dim[d][np.arange(B), actions[:, d]]) for d in range(3))
    np.testing.assert_allclose(np.asarray(logprob), want, rtol=1e-5, atol=1e-5)
    want_entropy = sum(
        -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=1) for p in per_dim
    )
    np.testing.assert_allclose(np.asarray(entropy), want_entropy, rtol=1e-5, atol=1e-5)

    samples = np.asarray(
        ppo.sample_action(
            jnp.tile(logits[:1], (DRAWS, 1)),
            jax.random.split(jax.random.PRNGKey(4), DRAWS),
            False,
            False,
            jnp.tile(legal[:1], (DRAWS, 1, 1)),
        )
    )
    assert samples.shape == (DRAWS, 3)
    for d in range(3):
        assert np.all(legal[0, d][samples[:, d]] == 1) and samples[:, d].max() < heads[d]
        if heads[d] > 1 and legal[0, d].sum() > 1:
            assert chi_square_p(samples[:, d], per_dim[d][0]) > 1e-3, d


def test_a_joint_mask_is_flattened_as_the_env_unravels_its_index():
    """Minesweeper's (10, 10) mask: the policy's action i is legal exactly where the mask's cell
    that tasks.env_action sends for i is; without the mask (--no-action-mask) nothing is masked."""
    obs_space, action_space = tasks.spaces("Minesweeper-v0")
    assert tasks.policy_space("Minesweeper-v0") == gymnasium.spaces.Discrete(100)
    mask = random_legal_rows(np.random.default_rng(5), (2, 10, 10))
    network = ppo.ActorCritic(100, False, tasks.encoders(obs_space), 0, (), True)
    legal = np.asarray(ppo.legal_actions(network, {"action_mask": mask}, jnp.zeros((2, 100))))
    cells = tasks.env_action(np.arange(100), action_space)  # [100, 2]
    for b in range(2):
        np.testing.assert_array_equal(legal[b], mask[b][cells[:, 0], cells[:, 1]])
    assert (
        ppo.legal_actions(
            network.clone(action_mask=False), {"action_mask": mask}, jnp.zeros((2, 100))
        )
        is None
    )


# ---------------------------------------------------------------------------------------------
# The learner recomputes with the masks stored with each transition
# ---------------------------------------------------------------------------------------------

OBS_SPACE = gymnasium.spaces.Dict(
    {
        "x": gymnasium.spaces.Box(-1.0, 1.0, (3,), np.float32),
        "action_mask": gymnasium.spaces.MultiBinary(5),
    }
)


class MaskedInside(ppo.ActorCritic):
    """The reference: the network itself puts its illegal logits at the lowest float, so the
    script's own masking (action_mask False) is not needed."""

    def __call__(self, obs, core=None):
        pi, value, state = super().__call__(obs, core)
        return jnp.where(obs["action_mask"] > 0, pi, jnp.finfo(pi.dtype).min), value, state


def masked_rollout(module, network, params, T=8, B=4, seed=0):
    """A rollout [T, B] acted by the script's own policy step on random observations and masks."""
    rng = np.random.default_rng(seed)
    obs = {
        "x": rng.uniform(-1, 1, (T + 1, B, 3)).astype(np.float32),
        "action_mask": random_legal_rows(rng, (T + 1, B, 5)),
    }
    policy_step, key = module.make_policy_step(network, False), jax.random.PRNGKey(seed)
    actions, logprobs, values = [], [], []
    for t in range(T):
        action, logprob, value, _ = policy_step(
            params, jax.tree.map(lambda x: x[t], obs), None, key, np.arange(B), np.full(B, t)
        )
        actions.append(action), logprobs.append(logprob), values.append(value)
    dones = (rng.random((T, B)) < 0.1).astype(np.float32)
    return {
        "obs": jax.tree.map(lambda x: x[:T], obs),
        "bootstrap_obs": jax.tree.map(lambda x: x[T], obs),
        "actions": np.stack(actions),
        "logprobs": np.stack(logprobs),
        "values": np.stack(values),
        "rewards": rng.normal(size=(T, B)).astype(np.float32),
        "dones": dones,
        "truncated": np.zeros((T, B), np.float32),
        "valid": np.ones((T, B), np.float32),
        "policy_version": np.zeros((T, B), np.int32),
    }


@pytest.mark.parametrize("script", ["ppo_sync_baseline.py", "appo_envpool.py", "impala_envpool.py"])
def test_the_learner_recomputes_with_the_stored_masks(script):
    """The actor's masked log-probabilities are what the learner recomputes (APPO: V-trace's
    ratios start at 1, KL 0); recomputing without the stored masks changes the loss; the update
    equals the reference's, a network that masks its own logits."""
    module = load_script(script)
    small = (
        {} if script == "impala_envpool.py" else dict(update_epochs=2, num_minibatches=2)
    )  # a quick compile
    args = module.resolve_args(
        module.Args(env_id="CartPole-v1", num_envs=4, num_steps=8, total_timesteps=10_000, **small)
    )
    network = module.ActorCritic(5, False, tasks.encoders(OBS_SPACE), 0, (), True)
    params = network.init(jax.random.PRNGKey(0), tasks.zeros_like_space(OBS_SPACE, 1))
    # Large output weights: the policy is far from uniform, so masks change it a lot.
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x * 300 if "Dense_4" in jax.tree_util.keystr(p) else x, params
    )
    optimizer = module.make_optimizer(args)
    state = {
        "params": params,
        "opt_state": optimizer.init(params),
        "global_step": 0,
        "policy_version": 0,
    }
    rollout = jax.tree.map(jnp.asarray, masked_rollout(module, network, params))
    results = {}
    for name, net in [
        ("masked", network),
        ("unmasked", network.clone(action_mask=False)),
        ("reference", MaskedInside(5, False, tasks.encoders(OBS_SPACE))),
    ]:
        results[name] = module.make_update(net, optimizer, args, False)(
            state, rollout, jax.random.PRNGKey(1), args.total_timesteps
        )
    (masked, d_masked), (unmasked, d_unmasked), (reference, _) = (
        results[k] for k in ("masked", "unmasked", "reference")
    )
    if "async/start_kl" in d_masked:
        assert (
            abs(float(d_masked["async/start_kl"])) < 1e-6
            and float(d_unmasked["async/start_kl"]) > 0.01
        )
    assert abs(float(d_masked["loss"]) - float(d_unmasked["loss"])) > 1e-3
    for a, b in zip(jax.tree.leaves(masked["params"]), jax.tree.leaves(reference["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert any(
        not np.allclose(a, b, atol=1e-6)
        for a, b in zip(jax.tree.leaves(masked["params"]), jax.tree.leaves(unmasked["params"]))
    )


# ---------------------------------------------------------------------------------------------
# DQN: ε-greedy, greedy actions and the target's maximum over legal actions
# ---------------------------------------------------------------------------------------------


def test_dqn_random_legal_draws_uniformly_among_legal_actions():
    rng = np.random.default_rng(6)
    legal = np.array([[0, 1, 1, 0, 1, 0, 0, 1], [0, 0, 0, 0, 0, 1, 0, 0]], np.int8)
    samples = np.stack(
        [dqn.random_legal(legal, rng.random(2)) for _ in range(DRAWS // 2)]
    )  # [N, 2]
    assert np.all(legal[0][samples[:, 0]] == 1) and np.all(samples[:, 1] == 5)
    assert chi_square_p(samples[:, 0], legal[0] / legal[0].sum()) > 1e-3
    assert dqn.random_legal(np.zeros((1, 4), np.int8), rng.random(1)).tolist() == [
        0
    ]  # none legal: action 0


def test_dqn_epsilon_greedy_never_takes_an_illegal_action():
    """10^5 steps of ε-greedy at ε 0.5 on random masks: exploring and greedy, every action legal;
    the greedy one is the best legal Q-value."""
    rng = np.random.default_rng(7)
    B, A, steps = 100, 9, DRAWS // 100
    network = dqn.QNetwork(A, (("flat", 1.0),), action_mask=True)
    q_weights = (
        rng.normal(size=(A,)).astype(np.float32) * 10
    )  # Q = x * w: the greedy action is visible
    greedy = jax.jit(
        lambda params, obs: dqn.legal_argmax(
            obs["x"] * q_weights, dqn.legal_actions(network, obs, len(obs["x"]))
        )
    )
    taken = explored = 0
    for _ in range(steps):
        obs = {"x": np.ones((B, A), np.float32), "action_mask": random_legal_rows(rng, (B, A))}
        legal = dqn.legal_actions(network, obs, B)
        action = dqn.epsilon_greedy(
            greedy, None, obs, np.full(B, 0.5), A, rng.random((B, 2)), legal
        )
        assert np.all(obs["action_mask"][np.arange(B), action] == 1)
        best = np.argmax(np.where(obs["action_mask"] > 0, q_weights, -np.inf), axis=1)
        taken, explored = taken + B, explored + np.count_nonzero(action != best)
    assert taken == DRAWS and 0.1 * DRAWS < explored < 0.5 * DRAWS


@pytest.mark.parametrize("double", [False, True])
def test_dqn_targets_take_the_maximum_over_legal_next_actions(double):
    rng = np.random.default_rng(8)
    B, A = 12, 6
    next_target, next_online = rng.normal(size=(2, B, A)).astype(np.float32)
    legal = random_legal_rows(rng, (B, A))
    legal[0] = 0  # none legal (a game's last observation, discount 0): finite
    reward, discount = rng.normal(size=B).astype(np.float32), np.full(B, 0.9, np.float32)
    discount[0] = 0.0
    got = np.asarray(dqn.q_targets(next_target, next_online, reward, discount, double, legal))
    for b in range(B):
        choice = next_online[b] if double else next_target[b]
        best = max(np.flatnonzero(legal[b]), key=lambda a: choice[a]) if legal[b].any() else 0
        assert got[b] == pytest.approx(reward[b] + discount[b] * next_target[b, best], rel=1e-6), b


# ---------------------------------------------------------------------------------------------
# End to end: no illegal action reaches the env (tests/user_envs.py's LegalMoves, strict: it raises)
# ---------------------------------------------------------------------------------------------

STRICT = ["--env-id", "tests.user_envs:LegalMoves", "--env-kwargs", '{"strict": true}']


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", ["appo_envpool.py", "appo_envpool_xla.py"])
@pytest.mark.parametrize("env_id", ["Minesweeper-v0", "Connector-v2"])
def test_both_actors_act_legally_and_the_env_gets_the_cell_the_policy_chose(script, env_id):
    """The Python and the XLA actor (whose unravelling runs inside its jitted loop), on a joint and
    a factored task: every action a rollout stores is legal under the mask stored with it, and its
    actions replayed through tasks.env_action in a synchronous envpool give back its
    observations."""
    module, B = load_script(script), 4
    args = module.resolve_args(module.Args(env_id=env_id, num_envs=B, num_steps=16, num_splits=2))
    network, _, continuous, normalizer, state = module.build(args, jax.random.PRNGKey(0))
    shared = threads.Shared(state["params"], 0, normalizer)
    envs, rollouts = tasks.make_env(env_id, B, 3, 1, train=True, batch_size=B // 2), queue.Queue()
    module.actor_loop(
        envs,
        module.make_policy_step(network, continuous, values=False),
        shared,
        rollouts,
        jax.random.PRNGKey(1),
        args,
        tasks.policy_space(args.env_id),
        2,
    )
    envs.close()
    rollouts = [rollouts.get_nowait() for _ in range(2)]
    sync = tasks.make_env(env_id, B, 3, 1, train=True)
    obs, _ = sync.reset()
    for rollout in rollouts:
        mask, actions = rollout.obs["action_mask"], rollout.actions
        if network.heads:  # [T, B, D] of D choices
            legal = np.take_along_axis(mask, actions[..., None].astype(int), axis=-1)[..., 0].all(
                axis=-1
            )
        else:  # [T, B] indices into the flattened joint mask
            legal = np.take_along_axis(
                mask.reshape(*actions.shape, -1), actions[..., None].astype(int), axis=-1
            )[..., 0]
        valid = rollout.valid > 0
        assert valid.sum() > 0 and np.all(legal[valid] == 1)
        for t in range(len(actions)):
            for key in obs:
                np.testing.assert_array_equal(rollout.obs[key][t], obs[key])
            obs = sync.step(tasks.env_action(actions[t], sync.action_space))[0]
    sync.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", ["ppo_sync_baseline.py", "appo_envpool.py", "impala_envpool.py"])
def test_the_ppo_family_never_takes_an_illegal_action(script, tmp_path, capsys):
    """Acting (sampled), evaluation (sampled and greedy: utils/evaluate.py's --greedy plays the
    script's make_policy_step with greedy=True) over a few thousand steps: the env never raises."""
    flags = [
        "--total-timesteps",
        4096,
        "--num-envs",
        8,
        "--num-steps",
        32,
        "--eval-episodes",
        4,
        "--run-dir",
        tmp_path / "run",
        "--compile-cache",
        "",
    ]
    code, _, err = run_main(script, STRICT + flags, capsys)
    assert code == 0, err
    module = load_script(script)
    args = module.resolve_args(
        module.Args(env_id="tests.user_envs:LegalMoves", env_kwargs='{"strict": true}')
    )
    network, _, continuous, normalizer, state = module.build(args, jax.random.PRNGKey(0))
    greedy = module.make_policy_step(network, continuous, values=False, greedy=True)
    scores = evaluation.evaluate(greedy, state["params"], lambda n: None, args, normalizer, 8)
    assert len(scores) == 8


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dqn_never_takes_an_illegal_action_over_100k_steps(tmp_path, capsys):
    """10^5 env steps, ε from 1 to 0 over the first 30% (exploring, then greedy: its greedy action
    among the legal ones), then the evaluation's games: the strict env never raises."""
    # 1,563 rounds of 64
    flags = [
        "--total-timesteps",
        100_032,
        "--num-envs",
        8,
        "--num-steps",
        8,
        "--learning-starts",
        1000,
        "--replay-ratio",
        1,
        "--batch-size",
        64,
        "--buffer-size",
        20_000,
        "--exploration-fraction",
        0.3,
        "--end-e",
        0,
        "--eval-episodes",
        8,
        "--run-dir",
        tmp_path / "run",
        "--compile-cache",
        "",
    ]
    code, _, err = run_main("dqn_envpool.py", STRICT + flags, capsys)
    assert code == 0, err
    records = read_metrics(tmp_path / "run")
    assert max(r["step"] for r in records) >= 100_000
    assert (
        min(r["value"] for r in records if r["tag"] == "charts/epsilon") == 0.0
    )  # greedy by the end


def test_dqn_refuses_a_factored_policy_with_one_line(tmp_path, capsys):
    code, _, err = run_main(
        "dqn_envpool.py", ["--env-id", "Connector-v2", "--run-dir", tmp_path / "run"], capsys
    )
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--env-id Connector-v2 has multi-discrete actions" in err and "appo_envpool.py" in err, (
        err
    )
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# Learning: LegalMoves (8 actions, 3 legal each step, the target +1, an illegal action ends the game
# at -1, 16 steps a game; knowing only the mask scores 16/3 = 5.3). Default flags, 20-episode
# means; measured (docs/families.md, seeds 1 and 2): to 12, APPO 35.8k and 32.7k steps masked,
# 45.0k and 42.9k with --no-action-mask; DQN 60.6k and 59.1k masked, 96.4k and 96.9k without.
# ---------------------------------------------------------------------------------------------

LEGAL_MOVES_BUDGET = {"appo_envpool.py": 100_000, "dqn_envpool.py": 120_000}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", list(LEGAL_MOVES_BUDGET))
def test_masked_agents_learn_legal_moves(script, tmp_path, capsys):
    flags = [
        "--env-id",
        "tests.user_envs:LegalMoves",
        "--seed",
        1,
        "--total-timesteps",
        LEGAL_MOVES_BUDGET[script],
        "--eval-episodes",
        0,
        "--run-dir",
        tmp_path / "run",
    ]
    code, _, err = run_main(script, flags, capsys)
    assert code == 0, err
    returns = [
        r["value"] for r in read_metrics(tmp_path / "run") if r["tag"] == "charts/episodic_return"
    ]
    means = np.convolve(returns, np.ones(20) / 20, "valid")
    assert means[0] < 8 and means.max() >= 12, (means[0], means.max())


# ---------------------------------------------------------------------------------------------
# A mask that cannot be obeyed: refused at start-up (floats), or the env named where it is seen
# ---------------------------------------------------------------------------------------------

LEGAL_MOVES = "tests.user_envs:LegalMoves"


class WrongMasks:
    """envpool's interface (async_reset, recv and send; reset and step for the sync loop) over B
    envs of LegalMoves' observations (3 of 8 actions legal) whose mask goes wrong at step `at` of
    their episodes: "empty" (no legal action, the game going on) or "two" (a value 2): the actor
    loops run on it without worker processes."""

    def __init__(self, B: int, kind: str, at: int = 3, split: int = 0):
        self.B, self.kind, self.at, self.split = B, kind, at, split or B
        self.observation_space = tasks.spaces(LEGAL_MOVES)[0]
        self.action_space = gymnasium.spaces.Discrete(8)
        self.t, self.pending = np.zeros(B, np.int64), []

    def batch(self, ids):
        mask = np.zeros((len(ids), 8), np.int8)
        mask[:, :3] = 1
        wrong = self.t[ids] == self.at
        if self.kind == "empty":
            mask[wrong] = 0
        else:
            mask[wrong, 0] = 2
        zeros = np.zeros(len(ids), bool)
        info = {"env_id": ids, "elapsed_step": self.t[ids].copy()}
        return (
            {"target": np.zeros(len(ids), np.int64), "action_mask": mask},
            np.zeros(len(ids)),
            zeros,
            zeros,
            info,
        )

    def async_reset(self):
        self.pending = [np.arange(i, i + self.split) for i in range(0, self.B, self.split)]

    def recv(self):
        return self.batch(self.pending.pop(0))

    def send(self, action, env_ids):
        self.t[env_ids] += 1
        self.pending.append(np.asarray(env_ids))

    def reset(self):
        return self.batch(np.arange(self.B))[0], {}

    def step(self, action):
        self.t += 1
        return self.batch(np.arange(self.B))


def test_a_float_mask_is_refused_at_start_up_naming_the_env_and_the_space(tmp_path, capsys):
    obs_space = gymnasium.spaces.Dict(
        {"action_mask": gymnasium.spaces.Box(0.0, 1.0, (8,), np.float32)}
    )
    with pytest.raises(
        UsageError,
        match=r"--env-id Mine-v0: its 'action_mask' Box\(.*float32\) is not of bools or ints \(a "
        r"mask's\); rename the leaf",
    ):
        tasks.check_spaces("Mine-v0", obs_space, gymnasium.spaces.Discrete(8))
    for dtype in (np.int8, np.bool_, np.int64):  # integer and bool masks pass
        tasks.check_spaces(
            "Mine-v0",
            gymnasium.spaces.Dict({"action_mask": gymnasium.spaces.Box(0, 1, (8,), dtype)}),
            gymnasium.spaces.Discrete(8),
        )
    code, _, err = run_main(
        "ppo_sync_baseline.py",
        ["--env-id", "tests.user_envs:FloatMask", "--run-dir", tmp_path / "run"],
        capsys,
    )
    assert code == 2 and len(err.strip().splitlines()) == 1 and "'action_mask' Box(" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "kind, says",
    [
        ("empty", "no legal action at step 3 of its episode"),
        ("two", "values other than 0 and 1 ([0, 1, 2]) at step 3 of its episode"),
    ],
)
@pytest.mark.parametrize(
    "script", ["ppo_sync_baseline.py", "appo_envpool.py", "impala_envpool.py", "dqn_envpool.py"]
)
def test_a_mask_that_cannot_be_obeyed_stops_the_actor_naming_the_env_and_step(script, kind, says):
    """Each actor loop that applies masks (the sync loop, the Python actor, the replay rounds'
    collect: DQN's) raises gym_pool.EnvError (the run's one line, exit 1, a checkpoint) where it
    used to play action 0 in silence. An episode's last observation may have none legal (Jumanji's
    games end so): test_lib_tasks has check_legal's cases."""
    module, B = load_script(script), 4
    flags = {
        "ppo_sync_baseline.py": {},
        "dqn_envpool.py": dict(num_splits=2, batch_size=32, replay_ratio=1.0),
    }
    args = module.resolve_args(
        module.Args(
            env_id=LEGAL_MOVES, num_envs=B, num_steps=8, **flags.get(script, dict(num_splits=2))
        )
    )
    envs = WrongMasks(B, kind, split=B // 2)
    with pytest.raises(gym_pool.EnvError, match=rf"env \d's 'action_mask' has {re.escape(says)}"):
        if script == "dqn_envpool.py":
            envs.async_reset()

            def act(params, obs, ids, steps, first):
                return np.zeros(len(ids), np.int64), None

            shared, collecting = threads.Shared(None, 0), Collecting(B, 0, 0)
            module.collect(envs, act, None, 0, collecting, args, shared, 0)
            return
        network, _, continuous, normalizer, state = module.build(args, jax.random.PRNGKey(0))
        policy_step = module.make_policy_step(
            network, continuous, values=script == "ppo_sync_baseline.py"
        )
        if script == "ppo_sync_baseline.py":
            obs = envs.reset()[0]
            module.collect_rollout(
                envs,
                policy_step,
                state["params"],
                obs,
                np.zeros(B, bool),
                None,
                jax.random.PRNGKey(1),
                0,
                tasks.EpisodeStats(B),
                normalizer,
                args,
                tasks.policy_space(args.env_id),
                {"env": 0.0, "inference": 0.0},
            )
        else:
            module.actor_loop(
                envs,
                policy_step,
                threads.Shared(state["params"], 0, normalizer),
                queue.Queue(),
                jax.random.PRNGKey(1),
                args,
                tasks.policy_space(args.env_id),
                2,
            )


def test_the_xla_actor_names_a_mask_with_no_legal_action(monkeypatch):
    """appo_envpool_xla.py's actor checks each rollout's masks as it comes back from its jitted loop
    (Minesweeper-v0, its masks emptied inside the loop where the actor reads them)."""
    module, B = load_script("appo_envpool_xla.py"), 4
    args = module.resolve_args(
        module.Args(env_id="Minesweeper-v0", num_envs=B, num_steps=4, num_splits=2)
    )
    network, _, continuous, normalizer, state = module.build(args, jax.random.PRNGKey(0))
    f32 = module.f32

    def emptied(tree):  # the observations the loop stores: no legal action in any
        tree = f32(tree)
        return (
            dict(tree, action_mask=jnp.zeros_like(tree["action_mask"]))
            if isinstance(tree, dict)
            else tree
        )

    monkeypatch.setattr(module, "f32", emptied)
    envs = tasks.make_env("Minesweeper-v0", B, 3, 1, train=True, batch_size=B // 2)
    try:
        with pytest.raises(
            gym_pool.EnvError,
            match=r"env \d's 'action_mask' has no legal action at step \d+ of the run",
        ):
            module.actor_loop(
                envs,
                module.make_policy_step(network, continuous, values=False),
                threads.Shared(state["params"], 0, normalizer),
                queue.Queue(),
                jax.random.PRNGKey(1),
                args,
                tasks.policy_space(args.env_id),
                1,
            )
    finally:
        envs.close()
