"""The asynchronous pipeline of the actor/learner scripts: trajectory integrity under envpool's
out-of-order `recv()`, version stamps and backpressure (the Python actor's scripts,
helpers.PYTHON_ACTOR_SCRIPTS; appo_envpool_xla.py's actor: tests/test_xla_actor.py), policy-lag
masking, and failure of either thread (docs/DESIGN.md, "The asynchronous pipeline")."""

import dataclasses
import queue
import signal
import threading
import time

import flax.linen as nn
import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (
    ASYNC_SCRIPTS,
    PYTHON_ACTOR_SCRIPTS,
    REPO_ROOT,
    TINY_BATCH,
    TINY_FLAGS,
    describe,
    load_script,
    read_metrics,
    run_script,
    tag_values,
    tiny_flags,
)
from jax_async_rl import tasks, threads

# ---------------------------------------------------------------------------------------------
# A deterministic stand-in for envpool's asynchronous interface
# ---------------------------------------------------------------------------------------------

ACTION_SPACE_N = 1_000_000


def code(env, n):
    """The number that encodes (env id, count): observations, actions and log-probs carry it."""
    return 1000 * env + n


class ScriptedEnvPool:
    """envpool's async API (`async_reset`, `recv`, `send`) over `num_envs` scripted envs.

    Env e's n-th observation (n counts every observation it ever returned, reset ones too) is
    [e, n]. Its episodes take `episode_lengths[e]` steps; the last one is terminated, or truncated
    for the envs in `truncating`. As envpool does, the step after an episode's end resets the env
    (ignoring the action) and returns the first observation of the next episode. Every reward
    encodes (e, n) of the observation it comes with: 0.5 + code(e, n), except that a reset
    observation's reward is NaN (envpool's dm_control returns NaN there at times; the actor must
    record 0, since that reward belongs to no transition). `recv()` returns
    `batch_size` envs drawn at random (seeded) among the envs whose step is in flight, in random
    order. Everything each env returned and received is recorded, per env, in order.
    """

    def __init__(self, num_envs, batch_size, episode_lengths, truncating, seed):
        self.num_envs, self.batch_size = num_envs, batch_size
        self.episode_lengths, self.truncating = list(episode_lengths), set(truncating)
        self.rng = np.random.default_rng(seed)
        self.action_space = gymnasium.spaces.Discrete(ACTION_SPACE_N)
        self.count = np.zeros(num_envs, np.int64)  # observations returned so far, per env
        self.elapsed = np.zeros(num_envs, np.int64)
        self.ended = np.zeros(num_envs, bool)  # the last observation returned ended its episode
        self.in_flight = set()
        self.returned = [
            [] for _ in range(num_envs)
        ]  # per env: (obs, reward, terminated, truncated)
        self.received = [[] for _ in range(num_envs)]  # per env: actions, in order
        self.errors = []
        self.closed = False

    def async_reset(self):
        self.in_flight = set(range(self.num_envs))

    def recv(self):
        ready = sorted(self.in_flight)
        if len(ready) < self.batch_size:
            self.errors.append(f"recv() with only {len(ready)} envs in flight")
            raise RuntimeError(self.errors[-1])
        env_ids = self.rng.permutation(ready)[: self.batch_size]
        obs = np.zeros((self.batch_size, 2), np.float32)
        reward = np.zeros(self.batch_size, np.float32)
        terminated = np.zeros(self.batch_size, bool)
        truncated = np.zeros(self.batch_size, bool)
        for i, e in enumerate(env_ids):
            n = self.count[e]
            if n == 0 or self.ended[e]:
                self.elapsed[e] = 0
            else:
                self.elapsed[e] += 1
                if self.elapsed[e] == self.episode_lengths[e]:
                    truncated[i] = e in self.truncating
                    terminated[i] = e not in self.truncating
            self.ended[e] = terminated[i] or truncated[i]
            obs[i] = [e, n]
            reward[i] = 0.5 + code(e, n) if self.elapsed[e] > 0 else np.nan
            self.returned[e].append(
                (obs[i].copy(), float(reward[i]), bool(terminated[i]), bool(truncated[i]))
            )
            self.count[e] += 1
            self.in_flight.remove(e)
        info = {
            "env_id": env_ids.astype(np.int32),
            "elapsed_step": self.elapsed[env_ids].astype(np.int32),
        }
        return obs, reward, terminated, truncated, info

    def send(self, actions, env_ids):
        for action, e in zip(np.asarray(actions), np.asarray(env_ids)):
            if e in self.in_flight:
                self.errors.append(f"send() to env {e}, whose step is already in flight")
            self.received[e].append(int(action))
            self.in_flight.add(int(e))

    def close(self):
        self.closed = True


class ScriptedPolicy:
    """A `policy_step(params, obs, core, key, env_ids, steps)` stand-in (feed-forward: `core`
    None): the action and log-prob encode the observation; the parameters are the version itself.
    It records, per (env, count), the version that `shared.latest` held during the call, checks
    that `steps` are the envs' own step counts, then publishes a new version every
    `publish_every` calls, as the learner would."""

    def __init__(self, shared, publish_every=3, fail_after=None):
        self.shared, self.publish_every = shared, publish_every
        self.calls = 0
        self.version_at = {}  # (env, count) -> version in shared.latest during the call
        self.mismatch = []

    def __call__(self, params, obs, core, key, env_ids, steps):
        assert core is None
        latest_params, version = self.shared.latest
        if params != latest_params:
            self.mismatch.append((params, latest_params))
        env, n = np.asarray(obs, np.int64).T
        if not (np.array_equal(env, env_ids) and np.array_equal(n, steps)):
            self.mismatch.append(("steps", env_ids, steps))
        for e, c in zip(env, n):
            self.version_at[(int(e), int(c))] = version
        self.calls += 1
        if self.calls % self.publish_every == 0:
            self.shared.publish(version + 1, version + 1)
        action = code(env, n)
        return action, -action.astype(np.float32), np.zeros(len(obs), np.float32), None


# (num_envs of each split, rollout length); episode lengths and truncation per env
SPLIT_SIZE, NUM_STEPS = 3, 5
EPISODE_LENGTHS = [
    4,
    2,
    6,
    1,
    9,
    3,
    5,
    4,
    7,
    2,
    10,
    3,
]  # 4 + the reset step = NUM_STEPS: ends on a boundary
TRUNCATING = {1, 4, 7, 10}


def make_pipeline(module, num_splits, queue_size=0, seed=0):
    """ScriptedEnvPool + ScriptedPolicy + Shared + args for `module`'s actor_loop."""
    num_envs = num_splits * SPLIT_SIZE
    envs = ScriptedEnvPool(num_envs, SPLIT_SIZE, EPISODE_LENGTHS[:num_envs], TRUNCATING, seed)
    shared = threads.Shared(0, 0)
    policy = ScriptedPolicy(shared)
    args = dataclasses.replace(
        module.Args(env_id="CartPole-v1"),
        num_envs=num_envs,
        num_steps=NUM_STEPS,
        num_splits=num_splits,
    )
    return envs, policy, shared, args, queue.Queue(maxsize=queue_size)


def check_rollouts(rollouts, envs, policy):
    """Every env's trajectory, as the env saw it, is in the rollouts exactly once and in order."""
    assert not envs.errors, envs.errors
    assert not policy.mismatch, "the actor did not pass the newest parameters"
    T, B = NUM_STEPS, envs.num_envs
    for k, rollout in enumerate(rollouts):
        assert rollout.obs.shape == (T, B, 2) and rollout.bootstrap_obs.shape == (B, 2)
        for name in [
            "actions",
            "logprobs",
            "rewards",
            "dones",
            "truncated",
            "valid",
            "policy_version",
        ]:
            assert getattr(rollout, name).shape == (T, B), name
        for e in range(B):
            for t in range(T):
                n = k * T + t  # env e's n-th transition: from its n-th to its (n+1)-th observation
                obs, _, term, trunc = envs.returned[e][n]
                _, next_reward, next_term, next_trunc = envs.returned[e][n + 1]
                where = f"rollout {k}, row {t}, env {e} (transition {n})"
                np.testing.assert_array_equal(rollout.obs[t, e], obs, err_msg=where)
                assert tuple(rollout.obs[t, e]) == (e, n), where
                assert rollout.actions[t, e] == envs.received[e][n] == code(e, n), where
                assert rollout.logprobs[t, e] == -code(e, n), where
                if np.isnan(next_reward):  # a reset observation: the actor records 0
                    assert rollout.valid[t, e] == 0.0 and rollout.rewards[t, e] == 0.0, where
                else:
                    assert rollout.rewards[t, e] == next_reward == 0.5 + code(e, n + 1), where
                assert rollout.dones[t, e] == float(next_term or next_trunc), where
                assert rollout.truncated[t, e] == float(next_trunc), where
                # The step after an episode end only resets the env (its action is ignored).
                assert rollout.valid[t, e] == float(not (term or trunc)), where
                assert rollout.policy_version[t, e] == policy.version_at[(e, n)], where
            next_obs = envs.returned[e][(k + 1) * T][0]
            np.testing.assert_array_equal(
                rollout.bootstrap_obs[e], next_obs, err_msg=f"rollout {k}, env {e}"
            )
        if k + 1 < len(rollouts):
            np.testing.assert_array_equal(rollout.bootstrap_obs, rollouts[k + 1].obs[0])
    # Independently of the recording: episodes end where each env's length puts them.
    for e in range(B):
        period = EPISODE_LENGTHS[e] + 1
        dones = np.concatenate([r.dones[:, e] for r in rollouts])
        valid = np.concatenate([r.valid[:, e] for r in rollouts])
        n = np.arange(len(dones))
        np.testing.assert_array_equal(dones, (n + 1) % period == period - 1, err_msg=f"env {e}")
        np.testing.assert_array_equal(valid, n % period != period - 1, err_msg=f"env {e}")
    # The stamps did change during the rollouts (the check above can tell versions apart).
    assert len({int(v) for r in rollouts for v in r.policy_version.ravel()}) > 3


def drain(rollout_queue):
    items = []
    while True:
        try:
            items.append(rollout_queue.get_nowait())
        except queue.Empty:
            return items


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_splits", [1, 2, 4])
@pytest.mark.parametrize("script", PYTHON_ACTOR_SCRIPTS)
def test_actor_loop_trajectory_integrity(script, num_splits):
    module = load_script(script)
    envs, policy, shared, args, rollout_queue = make_pipeline(module, num_splits, seed=num_splits)
    num_rollouts = 6
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
    rollouts = drain(rollout_queue)
    assert len(rollouts) == num_rollouts
    check_rollouts(rollouts, envs, policy)
    # The shuffled order really was out of order, and some env ran ahead of others.
    if num_splits > 1:
        assert envs.count.max() > envs.count.min()
    # Each rollout carries the games that ended in it: each an env's episode length; the env
    # steps sampled (the run's counter) are every action sent.
    lengths = [length for rollout in rollouts for _, _, length in rollout.games]
    assert lengths and set(lengths) <= set(EPISODE_LENGTHS[: envs.num_envs])
    assert int(shared.sampled.sum()) == sum(len(actions) for actions in envs.received)


class CountingQueue(queue.Queue):
    """A queue.Queue that counts the items put into it."""

    def __init__(self, maxsize):
        super().__init__(maxsize)
        self.puts = 0

    def _put(self, item):
        self.puts += 1
        super()._put(item)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", PYTHON_ACTOR_SCRIPTS)
def test_full_queue_blocks_the_actor_and_loses_nothing(script):
    module = load_script(script)
    envs, policy, shared, args, _ = make_pipeline(module, num_splits=2, seed=7)
    rollout_queue = CountingQueue(maxsize=1)
    num_rollouts = 5
    lifetime = threads.Threads(shared.stop)
    actor = lifetime.start(
        "actor",
        module.actor_loop,
        envs,
        policy,
        shared,
        rollout_queue,
        jax.random.PRNGKey(0),
        args,
        tasks.policy_space(args.env_id),
        num_rollouts,
    )
    try:
        # The consumer does not read: the actor fills the queue, completes one more rollout, blocks.
        deadline = time.monotonic() + 60
        while not (rollout_queue.puts == 1 and (envs.count.min() - 1) // NUM_STEPS >= 2):
            assert time.monotonic() < deadline, (
                f"actor did not block: {rollout_queue.puts} puts, {envs.count}"
            )
            assert actor.is_alive(), lifetime.errors
            time.sleep(0.01)
        blocked_at = time.monotonic()
        counts = envs.count.copy()
        waited_before = shared.timing["queue_put"]
        time.sleep(1.0)
        assert np.array_equal(envs.count, counts), (
            "the actor kept stepping the envs with a full queue"
        )
        assert rollout_queue.puts == 1 and rollout_queue.qsize() == 1
        # queue_size in the queue + exactly one complete rollout in hand, none beyond.
        assert (envs.count.min() - 1) // NUM_STEPS == 2

        rollouts = []
        while len(rollouts) < num_rollouts:
            assert time.monotonic() < deadline, f"only {len(rollouts)} rollouts arrived"
            try:
                rollouts.append(rollout_queue.get(timeout=1.0))
            except queue.Empty:
                assert actor.is_alive(), lifetime.errors
        released_after = time.monotonic() - blocked_at
        actor.join(timeout=10)
        assert not actor.is_alive()
    finally:
        shared.stop.set()
        actor.join(timeout=10)
    assert not lifetime.errors, lifetime.errors
    assert rollout_queue.puts == num_rollouts and rollout_queue.empty()
    # The blocked put is timed (the wait is logged as timing/queue_put_seconds).
    assert shared.timing["queue_put"] - waited_before >= 0.9 * min(released_after, 1.0)
    check_rollouts(rollouts, envs, policy)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script", PYTHON_ACTOR_SCRIPTS)
def test_actor_loop_stops_on_stop_event_while_blocked(script):
    """No put waits forever: with a full queue, setting `stop` ends the actor within seconds (it
    polls every 0.1 s; the margin is for a loaded machine)."""
    module = load_script(script)
    envs, policy, shared, args, _ = make_pipeline(module, num_splits=2)
    rollout_queue = queue.Queue(maxsize=1)
    lifetime = threads.Threads(shared.stop)
    actor = lifetime.start(
        "actor",
        module.actor_loop,
        envs,
        policy,
        shared,
        rollout_queue,
        jax.random.PRNGKey(0),
        args,
        tasks.policy_space(args.env_id),
        10,
    )
    deadline = time.monotonic() + 30
    while not rollout_queue.full():
        assert time.monotonic() < deadline and actor.is_alive(), lifetime.errors
        time.sleep(0.01)
    time.sleep(0.3)
    assert actor.is_alive()
    start = time.monotonic()
    shared.stop.set()
    actor.join(timeout=5)
    assert not actor.is_alive() and time.monotonic() - start < 3.0
    assert not lifetime.errors


# ---------------------------------------------------------------------------------------------
# Policy-lag masking in the jitted update
# ---------------------------------------------------------------------------------------------


class TinyActorCritic(nn.Module):
    """(logits [B, A], value [B]) from a single hidden layer of 8 units; a flat vector observation
    (`encoders` as the scripts' ActorCritic has them)."""

    action_dim: int
    encoders: tuple = (("flat", 1.0),)
    lstm_size: int = 0
    heads: tuple = ()  # one categorical, no legal-action mask (as the scripts' ActorCritic for CartPole)
    action_mask: bool = False

    @nn.compact
    def __call__(self, obs, core=None):
        hidden = nn.tanh(nn.Dense(8)(obs.reshape(obs.shape[0], -1).astype(jnp.float32)))
        return nn.Dense(self.action_dim)(hidden), nn.Dense(1)(hidden)[:, 0], None


LEARNER_VERSION, MAX_LAG = 10, 2
# Version stamps [T=6, B=5]; each column is non-decreasing in time, as an actor writes them.
STAMPS = np.array(
    [
        [9, 5, 3, 6, 1],
        [9, 6, 4, 7, 1],
        [10, 7, 5, 8, 2],
        [10, 8, 6, 8, 2],
        [10, 9, 7, 9, 3],
        [10, 10, 7, 10, 4],
    ],
    np.int32,
)
VALID = np.ones(STAMPS.shape, np.float32)
VALID[2, 1] = VALID[4, 3] = VALID[1, 2] = (
    0.0  # steps after an episode end: stale ones and a fresh one
)
STALE = LEARNER_VERSION - STAMPS > MAX_LAG


def synthetic_rollout(seed, num_actions=3):
    rng = np.random.default_rng(seed)
    T, B = STAMPS.shape
    dones = np.zeros((T, B), np.float32)
    dones[1, 1] = dones[3, 3] = dones[0, 2] = 1.0  # the episode ends before the invalid steps
    truncated = np.zeros((T, B), np.float32)
    truncated[0, 2] = 1.0
    return {
        "obs": rng.normal(size=(T, B, 3)).astype(np.float32),
        "actions": rng.integers(0, num_actions, size=(T, B)).astype(np.int64),
        "logprobs": np.log(rng.uniform(0.2, 0.5, size=(T, B))).astype(np.float32),
        "rewards": rng.normal(size=(T, B)).astype(np.float32),
        "dones": dones,
        "truncated": truncated,
        "valid": VALID.copy(),
        "policy_version": STAMPS.copy(),
        "bootstrap_obs": rng.normal(size=(B, 3)).astype(np.float32),
    }


def learner_args(module, **flags):
    """The resolved flags of a learner over rollouts of STAMPS' shape."""
    T, B = STAMPS.shape
    args = dataclasses.replace(
        module.Args(env_id="CartPole-v1"),
        **dict(
            tiny_flags(module.__name__ + ".py"),
            num_envs=B,
            num_steps=T,
            num_splits=1,
            total_timesteps=100 * T * B,
        ),
        max_policy_lag=MAX_LAG,
        **flags,
    )
    return module.resolve_args(args)


def learner(module, **flags):
    """make_update's jitted update for TinyActorCritic, and a state at version LEARNER_VERSION."""
    args = learner_args(module, **flags)
    network = TinyActorCritic(3)
    params = network.init(jax.random.PRNGKey(0), np.zeros((1, 3), np.float32))
    optimizer = module.make_optimizer(args)
    state = {
        "params": params,
        "opt_state": optimizer.init(params),
        "global_step": 0,
        "policy_version": LEARNER_VERSION,
    }
    return module.make_update(network, optimizer, args, False), state


def updated_params(update, state, rollout):
    new_state, diagnostics = update(state, rollout, jax.random.PRNGKey(1), 10**6)
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(new_state["params"])]), diagnostics


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", ["appo_envpool.py", "appo_envpool_xla.py"])
def test_the_update_measures_pi_against_mu_before_it_moves(script):
    """async/start_*: pi (the learner's parameters as the update starts) against mu (the logged
    log-probabilities), over the valid transitions: none outside the clip range and no KL when
    mu is pi; all outside it when mu is 1.5 pi, and the KL (r - 1 - log r, r = 2/3) exact."""
    module = load_script(script)
    update, state = learner(module)
    rollout = synthetic_rollout(0)
    T, B = STAMPS.shape
    network = TinyActorCritic(3)
    logits, _, _ = network.apply(state["params"], rollout["obs"].reshape(T * B, 3))
    pi = np.take_along_axis(
        np.asarray(jax.nn.log_softmax(logits)), rollout["actions"].reshape(-1, 1), 1
    ).reshape(T, B)
    _, same = updated_params(update, state, dict(rollout, logprobs=pi))
    assert float(same["async/start_clipfrac"]) == 0 and abs(float(same["async/start_kl"])) < 1e-6
    _, apart = updated_params(
        update, state, dict(rollout, logprobs=pi + np.log(1.5).astype(np.float32))
    )
    assert float(apart["async/start_clipfrac"]) == 1 and float(apart["async/rho_clipfrac"]) == 0
    assert float(apart["async/start_kl"]) == pytest.approx(2 / 3 - 1 - np.log(2 / 3), rel=1e-4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "script", ["ppo_sync_baseline.py", "appo_envpool.py", "appo_envpool_xla.py"]
)
def test_the_clip_anneals_with_the_budget(script):
    """--anneal-clip (the CartPole preset's): the clip epsilon is clip_coef x (1 - step / budget),
    and the loss clips at it: with pi/mu = 1/1.15 everywhere (|r - 1| = 0.13), one epoch of one
    minibatch measures no clipped transition at the start (0.2) and all of them half-way (0.1).
    The scheduled clip is logged; without the flag it is neither logged nor annealed."""
    module = load_script(script)
    asynchronous = (
        {"max_policy_lag": 100, "num_splits": 1} if hasattr(module.Args, "max_policy_lag") else {}
    )
    args = module.resolve_args(
        dataclasses.replace(
            module.Args(env_id="CartPole-v1"),
            **{
                **tiny_flags(script),
                "num_envs": 5,
                "num_steps": 6,
                "total_timesteps": 3000,
                "update_epochs": 1,
                "num_minibatches": 1,
                **asynchronous,
            },
        )
    )
    assert args.anneal_clip and args.clip_coef == 0.2  # the preset
    network = TinyActorCritic(3)
    params = network.init(jax.random.PRNGKey(0), np.zeros((1, 3), np.float32))
    optimizer = module.make_optimizer(args)
    rollout = synthetic_rollout(0)
    T, B = STAMPS.shape
    logits, values, _ = network.apply(params, rollout["obs"].reshape(T * B, 3))
    pi = np.take_along_axis(
        np.asarray(jax.nn.log_softmax(logits)), rollout["actions"].reshape(-1, 1), 1
    ).reshape(T, B)
    rollout = dict(
        rollout,
        logprobs=pi + np.log(1.15).astype(np.float32),
        values=np.asarray(values).reshape(T, B),
        policy_version=np.full((T, B), LEARNER_VERSION, np.int32),
    )
    for flag, step, clip, clipfrac in [
        (True, 0, 0.2, 0.0),
        (True, 1000, 0.2 * 2 / 3, 0.0),
        (True, 1500, 0.1, 1.0),
        (True, 3000, 0.0, 1.0),
        (False, 1500, None, 0.0),
    ]:
        update = module.make_update(
            network, optimizer, dataclasses.replace(args, anneal_clip=flag), False
        )
        state = {
            "params": params,
            "opt_state": optimizer.init(params),
            "global_step": step,
            "policy_version": LEARNER_VERSION,
        }
        _, diagnostics = update(state, rollout, jax.random.PRNGKey(1), 3000)
        assert float(diagnostics["clipfrac"]) == clipfrac, (flag, step)
        assert ("clip_coef" in diagnostics) == flag
        if flag:
            assert float(diagnostics["clip_coef"]) == pytest.approx(clip, abs=1e-7)


@pytest.mark.parametrize("script", ["appo_envpool.py", "appo_envpool_xla.py"])
def test_appo_advantages_carry_one_importance_weight(script):
    """APPO's targets with V-trace, pi 1.5x mu's probability on some transitions and 0.5x on
    others: V-trace's v_s (eq. 1, rho clipped at rho bar) as returns, and advantages without
    V-trace's rho, since PPO's ratio pi / mu weights each sample already (IMPALA's gradient,
    eq. 4, has one rho; both would give rho^2 where pi < mu)."""
    from test_math_async import vtrace_by_definition

    module = load_script(script)
    _, state = learner(module)
    args = learner_args(module)
    network = TinyActorCritic(3)
    rollout = synthetic_rollout(2)
    logprobs, _, values, bootstrap_value = module.rollout_forward(
        network, state["params"], rollout, False
    )
    shift = np.where(
        np.arange(STAMPS.size).reshape(STAMPS.shape) % 2, np.log(1.5), np.log(0.5)
    ).astype(np.float32)
    rollout["logprobs"] = np.asarray(logprobs) - shift  # log rho = shift
    advantages, returns, _, _ = module.targets(network, state, rollout, args, False, args.clip_coef)
    rewards = module.time_limit_bootstrap(
        rollout["rewards"], values, bootstrap_value, rollout["truncated"], args.gamma
    )
    inputs = (
        shift,
        args.gamma * (1.0 - rollout["dones"]),
        np.asarray(rewards),
        np.asarray(values),
        np.asarray(bootstrap_value),
    )
    want_vs, want_advantages = vtrace_by_definition(*inputs, 1.0, 1.0, None, lam=args.gae_lambda)
    np.testing.assert_allclose(np.asarray(returns), want_vs, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(advantages), want_advantages, rtol=1e-4, atol=1e-5)
    impala_weighted = vtrace_by_definition(*inputs, 1.0, 1.0, 1.0, lam=args.gae_lambda)[1]
    assert np.abs(impala_weighted - want_advantages).max() > 1e-2


# Every asynchronous script, and the GAE path of those that can turn V-trace off.
LEARNER_CASES = [(name, {}) for name in ASYNC_SCRIPTS] + [
    (name, {"vtrace": False})
    for name in ASYNC_SCRIPTS
    if "vtrace" in load_script(name).Args.__dataclass_fields__
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("script", "flags"),
    LEARNER_CASES,
    ids=lambda x: (
        x if isinstance(x, str) else ",".join(f"{k}={v}" for k, v in x.items()) or "defaults"
    ),
)
def test_update_masks_stale_transitions(script, flags):
    module = load_script(script)
    update, state = learner(module, **flags)
    rollout = synthetic_rollout(0)
    before = np.concatenate([np.ravel(x) for x in jax.tree.leaves(state["params"])])
    params, diagnostics = updated_params(update, state, rollout)
    assert bool(diagnostics["finite"])

    lag = LEARNER_VERSION - STAMPS.astype(np.float64)
    assert STALE[VALID > 0].any() and (~STALE)[VALID > 0].any() and STALE[VALID == 0].any()
    want_mean = (lag * VALID).sum() / VALID.sum()
    want_stale = (STALE * VALID).sum() / VALID.sum()
    assert lag.max() == lag[VALID > 0].max()  # (so max over all or over valid agree)
    assert float(diagnostics["async/policy_lag_mean"]) == pytest.approx(want_mean, rel=1e-6)
    assert float(diagnostics["async/policy_lag_max"]) == lag.max()
    assert float(diagnostics["async/stale_fraction"]) == pytest.approx(want_stale, rel=1e-6)
    new_state = update(state, rollout, jax.random.PRNGKey(1), 10**6)[0]
    assert int(new_state["policy_version"]) == LEARNER_VERSION + 1
    assert not np.allclose(params, before), "the update did not change the parameters"

    # Everything about the stale transitions changes: the parameters do not.
    other = synthetic_rollout(1)
    changed = dict(rollout)
    for name in ["obs", "actions", "logprobs", "rewards"]:
        stale = STALE.reshape(STALE.shape + (1,) * (rollout[name].ndim - 2))
        changed[name] = np.where(stale, other[name], rollout[name])
        assert not np.array_equal(changed[name], rollout[name]), name
    changed["dones"] = np.where(STALE, 1.0 - rollout["dones"], rollout["dones"]).astype(np.float32)
    changed["truncated"] = np.where(STALE, changed["dones"], rollout["truncated"]).astype(
        np.float32
    )
    params_stale_changed, diagnostics_stale = updated_params(update, state, changed)
    np.testing.assert_allclose(params_stale_changed, params, rtol=0, atol=1e-7)
    for name in ["async/policy_lag_mean", "async/policy_lag_max", "async/stale_fraction", "loss"]:
        assert float(diagnostics_stale[name]) == pytest.approx(
            float(diagnostics[name]), rel=1e-6
        ), name

    # ... while changing one fresh transition's reward does change them.
    t, b = 3, 0
    assert not STALE[t, b] and VALID[t, b]
    fresh_changed = dict(rollout, rewards=rollout["rewards"].copy())
    fresh_changed["rewards"][t, b] += 5.0
    params_fresh_changed, _ = updated_params(update, state, fresh_changed)
    assert np.abs(params_fresh_changed - params).max() > 1e-5

    # With every transition stale, nothing is learned (and nothing is non-finite).
    all_stale = dict(rollout, policy_version=np.zeros_like(STAMPS))
    params_all_stale, diagnostics_all = updated_params(update, state, all_stale)
    assert float(diagnostics_all["async/stale_fraction"]) == 1.0
    assert bool(diagnostics_all["finite"])
    np.testing.assert_allclose(params_all_stale, before, rtol=0, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Failure of a thread: the process exits non-zero within seconds, with the original traceback
# ---------------------------------------------------------------------------------------------

FAULT_PROGRAM = """
import dataclasses, sys, threading, time
sys.path.insert(0, {tests_dir!r})
from helpers import load_script, tiny_flags
from jax_async_rl.flags import exit_with

module = load_script({script!r})


long_call = threading.Event()  # the learner is inside its long first call


def report_fault():
    if {first_update_seconds}:
        long_call.wait(60)  # the fault while the learner is inside the call, whichever thread is first
    print(f"FAULT_AT {{time.time()!r}}", file=sys.stderr, flush=True)


def patched_make_update(*args, **kwargs):
    update = original_make_update(*args, **kwargs)
    calls = []

    def faulty_update(state, rollout, key, total_timesteps):
        calls.append(1)
        if len(calls) == 1 and {first_update_seconds}:
            print(f"LONG_CALL_AT {{time.time()!r}}", file=sys.stderr, flush=True)
            long_call.set()
            time.sleep({first_update_seconds})  # a learner inside one long call (an XLA compile)
        if len(calls) == 2 and {where!r} == "learner":
            report_fault()
            raise RuntimeError("injected learner fault")
        return update(state, rollout, key, total_timesteps)

    return faulty_update


def patched_make_policy_step(*args, **kwargs):
    policy_step = original_make_policy_step(*args, **kwargs)
    calls = []

    def faulty_policy_step(params, obs, core, key, env_ids, steps):
        calls.append(1)
        if len(calls) == {actor_fault_call} and {where!r} == "actor":
            report_fault()
            raise RuntimeError("injected actor fault")
        return policy_step(params, obs, core, key, env_ids, steps)

    return faulty_policy_step


def patched_collect(self, R):  # appo_envpool_xla.py: the actor's jitted call of a whole rollout
    call = original_collect(self, R)

    def faulty_collect(carry, params, version):
        collects.append(1)
        if len(collects) == {actor_fault_call} and {where!r} == "actor":
            report_fault()
            raise RuntimeError("injected actor fault")
        return call(carry, params, version)

    return faulty_collect


original_make_update, module.make_update = module.make_update, patched_make_update
if hasattr(module, "XlaRollouts"):
    original_collect, module.XlaRollouts.collect, collects = module.XlaRollouts.collect, patched_collect, []
else:
    original_make_policy_step, module.make_policy_step = module.make_policy_step, patched_make_policy_step
flags = dict(tiny_flags({script!r}), env_id="CartPole-v1", total_timesteps=10_000_000, run_dir={run_dir!r}, **{extra})
exit_with(module.main(dataclasses.replace(module.Args(), **flags)))  # as the scripts' entry point ends
"""


def check_fault_exit(script, where, tmp_path, actor_fault_call, first_update_seconds=0, extra=None):
    """Run FAULT_PROGRAM; the process must exit non-zero within 20 s of the fault (5 s of join
    deadline, then os._exit; the rest is margin for a loaded machine), printing the original
    traceback and message."""
    program = FAULT_PROGRAM.format(
        tests_dir=str(REPO_ROOT / "tests"),
        script=script,
        where=where,
        actor_fault_call=actor_fault_call,
        first_update_seconds=first_update_seconds,
        run_dir=str(tmp_path / "run"),
        extra=extra or {},
    )
    start = time.time()
    result = run_script("-c", [program], timeout=150)
    ended = time.time()
    assert result.returncode not in (0, None), describe(result)
    fault_lines = [line for line in result.stderr.splitlines() if line.startswith("FAULT_AT ")]
    assert len(fault_lines) == 1, describe(result)
    fault_at = float(fault_lines[0].split()[1])
    assert start < fault_at < ended
    if first_update_seconds:  # the fault came while the learner was inside its long call
        long_at = [
            float(line.split()[1])
            for line in result.stderr.splitlines()
            if line.startswith("LONG_CALL_AT ")
        ]
        assert long_at and long_at[0] <= fault_at < long_at[0] + first_update_seconds, describe(
            result
        )
    assert ended - fault_at < 20, (
        f"exited {ended - fault_at:.1f} s after the fault\n{describe(result)}"
    )
    message = f"injected {where} fault"
    assert f"RuntimeError: {message}" in result.stderr, describe(result)
    assert "Traceback (most recent call last)" in result.stderr, describe(result)
    # The original traceback: the frame that raised is in it.
    frame = (
        "update"
        if where == "learner"
        else "collect"
        if script == "appo_envpool_xla.py"
        else "policy_step"
    )
    assert f"in faulty_{frame}" in result.stderr, describe(result)


# The actor's call that fails: its 200th inference call (the Python actor, one call per recv());
# the XLA actor's 3rd rollout call, by when its 2 rollouts fill the queue.
ACTOR_FAULT_CALL = {"appo_envpool_xla.py": 3}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", ["appo_envpool.py", "impala_envpool.py", "appo_envpool_xla.py"])
def test_actor_lag_one_keeps_the_data_one_update_old(script, tmp_path, monkeypatch):
    """A learner far slower than the actor (each update sleeps 0.2 s first), one split, queue 2:
    the free-running actor (--actor-lag None) fills the queue and the learner learns from rollouts
    3 updates old; at --actor-lag 1 no transition is more than one update old when learned. The
    XLA actor chooses a rollout's row 0 at the end of the call before, so that row is 2 updates
    old: a mean lag of 1 + 1/T."""
    module = load_script(script)
    make_update = module.make_update

    def slow_update(*args, **kwargs):
        update = make_update(*args, **kwargs)
        return lambda *a, **k: time.sleep(0.2) or update(*a, **k)

    monkeypatch.setattr(module, "make_update", slow_update)
    lags, means = {}, {}
    for lag_one in (False, True):
        flags = dict(
            tiny_flags(script),
            env_id="CartPole-v1",
            num_splits=1,
            queue_size=2,
            actor_lag=1 if lag_one else None,
            total_timesteps=10 * TINY_BATCH,
            run_dir=str(tmp_path / str(lag_one)),
        )
        assert module.main(dataclasses.replace(module.Args(), **flags)) == 0
        records = read_metrics(tmp_path / str(lag_one))
        lags[lag_one], means[lag_one] = (
            tag_values(records, f"async/policy_lag_{x}") for x in ("max", "mean")
        )
    row_zero = script == "appo_envpool_xla.py"
    assert len(lags[True]) == 10 and max(lags[True]) <= 1 + row_zero and max(lags[False]) >= 3, lags
    assert (
        max(means[True]) <= 1 + row_zero / TINY_FLAGS["num_steps"] + 0.03
        and max(means[False]) >= 2.5
    ), means


@pytest.mark.timeout(200)
@pytest.mark.parametrize("where", ["learner", "actor"])
@pytest.mark.parametrize("script", ASYNC_SCRIPTS)
def test_thread_fault_exits_nonzero_with_traceback(script, where, tmp_path):
    """The learner fails on its 2nd update; or the actor on its 200th inference call (its 3rd
    rollout call: ACTOR_FAULT_CALL), by when backpressure (queue_size 2) has made it wait for the
    learner's first updates."""
    check_fault_exit(script, where, tmp_path, actor_fault_call=ACTOR_FAULT_CALL.get(script, 200))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("script", ASYNC_SCRIPTS)
def test_actor_fault_while_learner_is_in_a_long_call(script, tmp_path):
    """The actor fails while the learner is inside one 20 s call (as in the first XLA compile of
    the update, which takes that long for the Atari CNN on a busy CPU). At --actor-lag 2 the actor
    collects 3 rollouts on the first parameters, so each script's actor is acting during the call
    (at lag 1 the XLA actor's 3rd rollout, and free-running IMPALA's 2nd, wait for the call's end)."""
    check_fault_exit(
        script,
        "actor",
        tmp_path,
        actor_fault_call=ACTOR_FAULT_CALL.get(script, 40),
        first_update_seconds=20,
        extra=dict(actor_lag=2),
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", ASYNC_SCRIPTS)
def test_main_leaves_no_thread_behind(script, tmp_path):
    """A tiny run in this process: when main returns, the threads it started have ended."""
    module = load_script(script)
    before = set(threading.enumerate())
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        flags = dict(tiny_flags(script), env_id="CartPole-v1", run_dir=str(tmp_path / "run"))
        assert module.main(dataclasses.replace(module.Args(), **flags)) == 0
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert not left, f"threads started by main still alive after it returned: {left}"
    non_daemon = [
        t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()
    ]
    assert not non_daemon, non_daemon
    assert tag_values(read_metrics(tmp_path / "run"), "losses/policy_loss")
