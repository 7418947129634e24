"""Asynchronous TD3 and DDPG on envpool, in JAX: rlpyt's third family (Q-value policy gradient).

TD3 (Fujimoto et al. 2018): a deterministic policy with Gaussian exploration noise, twin critics
(the smaller of the two in every target), delayed policy and target updates, and target policy
smoothing (clipped noise on the target policy's action). DDPG (Lillicrap et al. 2016) is TD3 with
those three switched off: `--no-twin-q --policy-delay 1 --target-noise 0`. The defaults are
CleanRL's `td3_continuous_action.py` (its flags carry over).

Sampling and optimisation run asynchronously, as dqn_envpool.py's (rlpyt's async mode):
- actor threads step envpool splits (double buffering, Sample Factory §3.2) with the newest
  parameters, uniform random actions for the first --learning-starts steps (as CleanRL does),
  and hand the learner chunks of `num_steps` steps of every env;
- the learner owns the replay buffer (jax_async_rl.replay): it adds a chunk, runs
  `replay_ratio x chunk / batch_size` gradient steps on batches sampled from it, publishes.
  One chunk per round through a bounded queue holds the replay ratio whichever side is faster.
`--serial` runs the same functions in one thread, collect then update (rlpyt's serial mode).

The run itself (flags, folders, checkpoints, logs, devices) is the installed package
`jax_async_rl`: this file holds the algorithm. Usage: python td3_envpool.py --env-id HalfCheetah-v4
"""

import queue
import signal
import time
from dataclasses import dataclass
from typing import Annotated, ClassVar, Optional

# Ctrl-C while the libraries below import (seconds): exit 130, no traceback
if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    from jax_async_rl.helptext import help_from_source

    help_from_source(__file__)  # --help prints without the libraries below (their seconds)

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_async_rl import convolution, devices, flags, runs, tasks, threads
from jax_async_rl.flags import NON_NEGATIVE, POSITIVE, UNIT, UsageError, at_most
from jax_async_rl.keys import env_keys
from jax_async_rl.normalize import Normalizer
from jax_async_rl.replay import Collecting, Replay, check_rounds, gradient_steps, sample_rows

# evaluation_player's, in words (utils/evaluate.py)
EVAL_POLICY = "the deterministic policy, without exploration noise"


PRESETS = {}  # one configuration for every task: Args' defaults


@dataclass
class Args(flags.RunArgs):
    """Asynchronous TD3, or DDPG with --no-twin-q --policy-delay 1 --target-noise 0 (actor and
    learner threads, or --serial) for continuous actions. Every size is in agent steps. The defaults
    are CleanRL's td3_continuous_action.py."""

    # No flag takes a preset here (PRESETS, right above Args, is empty): every task starts
    # from the defaults below.
    env_id: str = "HalfCheetah-v4"
    """envpool task id with continuous (float Box) actions: MuJoCo (HalfCheetah-v4), dm_control
    (CheetahRun-v1), classic control (Pendulum-v1), Box2D, MetaWorld, ... (or your own Gymnasium
    env)"""
    num_envs: Annotated[int, POSITIVE, at_most(65_536)] = 1
    """number of parallel environments of each actor thread (see --num-actor-threads)"""
    num_splits: Annotated[int, POSITIVE] = 1
    """envpool splits for double-buffered sampling (Sample Factory §3.2); 1 disables it"""
    num_steps: Annotated[int, POSITIVE, at_most(65_536)] = 32
    """steps of every env in each chunk an actor hands the learner; the learner's round (one chunk,
    then its gradient steps) is an "update" in the logs and checkpoints"""
    queue_size: Annotated[int, POSITIVE, at_most(1024)] = 1
    """chunks an actor may queue ahead of the learner before it waits (backpressure)"""
    actor_lag: Annotated[Optional[int], NON_NEGATIVE, at_most(64)] = None
    """an actor collects chunk m with the round on chunk m - 1 - this (acting_version): 0, the
    serial mode's data; None, rlpyt's free-running actor (the newest parameters). --deterministic:
    exactly that round (1 where none is given), else at least it"""
    serial: bool = False
    """one thread: collect a chunk, then learn from the buffer, in turn (rlpyt's serial mode)"""
    buffer_size: Annotated[int, POSITIVE] = 1_000_000
    """replay buffer capacity in transitions (the oldest are overwritten)"""
    learning_starts: Annotated[int, NON_NEGATIVE] = 25_000
    """env steps of uniform random actions before the first gradient step (a resumed run refills its
    buffer this long, acting with its policy)"""
    replay_ratio: Annotated[float, POSITIVE, at_most(100_000.0)] = 256.0
    """transitions the learner samples per env step (CleanRL: one batch every step); each round's
    gradient steps are this x the chunk / --batch-size, a whole number"""
    batch_size: Annotated[int, POSITIVE] = 256
    """transitions in each gradient step's batch"""
    learning_rate: Annotated[float, POSITIVE] = 3e-4
    """Adam learning rate of the policy and of the Q-networks"""
    gamma: Annotated[float, UNIT] = 0.99
    """discount factor"""
    tau: Annotated[float, UNIT] = 0.005
    """target networks' Polyak rate: target <- tau x online + (1 - tau) x target"""
    policy_delay: Annotated[int, POSITIVE, at_most(1000)] = 2
    """gradient steps between policy steps, which also move the targets (TD3's delayed update,
    §5.2; DDPG: 1)"""
    twin_q: bool = True
    """two critics, the smaller in the target (TD3's clipped double Q-learning, §4.2); off:
    DDPG's one"""
    target_noise: Annotated[float, NON_NEGATIVE] = 0.2
    """std of the Gaussian noise on the target policy's action, x the action scale (TD3's target
    policy smoothing, §5.3; DDPG: 0)"""
    noise_clip: Annotated[float, NON_NEGATIVE] = 0.5
    """that noise clipped to [-this, this], x the action scale"""
    exploration_noise: Annotated[float, NON_NEGATIVE] = 0.1
    """std of the Gaussian noise on the actors' actions, x the action scale"""
    num_threads: Annotated[int, NON_NEGATIVE, at_most(1024)] = 0
    """envpool worker threads of each actor thread (0: the CPU cores shared among the actor
    threads)"""
    num_actor_threads: Annotated[int, POSITIVE, at_most(256)] = 1
    """actor threads on each actor device, each with num_envs envs of its own; a round takes one
    chunk from each"""
    save_interval: Annotated[int, NON_NEGATIVE] = 1000
    """write a checkpoint every this many rounds (0: only at the end)"""
    log_frequency: Annotated[int, POSITIVE] = 20
    """log losses, timings and SPS every this many rounds and after the last (returns: always)"""
    # The variants these flags make: the default --exp-name (the run's folder, its header line)
    # names them.
    NAMED: ClassVar[dict] = {
        "ddpg": dict(twin_q=False, policy_delay=1, target_noise=0.0),
        "serial": dict(serial=True),
    }


def resolve_args(args: Args) -> Args:
    """The flags checked: UsageError, one line, before anything starts (runs.checked holds the
    checks every script's flags take)."""
    tasks.preset_values(args, {"classic": {}})  # the task known and checked
    # Discrete, integer Box, MultiDiscrete
    if not np.issubdtype(tasks.spaces(args.env_id)[1].dtype, np.floating):
        raise UsageError(
            f"--env-id {args.env_id} has discrete actions; this script's policy is a continuous "
            "one: use dqn_envpool.py (or appo_envpool.py)"
        )
    space = tasks.spaces(args.env_id)[1]
    if not (np.all(np.isfinite(space.low)) and np.all(np.isfinite(space.high))):
        raise UsageError(
            f"--env-id {args.env_id} has unbounded actions; the policy's tanh needs finite bounds"
        )
    args = runs.checked(args)
    check_rounds(args, 5)
    return args


# ---------------------------------------------------------------------------------------------
# Networks
# ---------------------------------------------------------------------------------------------


def encode(obs, encoders: tuple):
    """The features [B, F] of an observation pytree: one encoder per leaf (`tasks.leaf_encoder`),
    concatenated. Called inside a module's `nn.compact` method, whose layers it adds."""

    def conv(x, size, kernel, stride=1):
        layer = nn.Conv(
            size,
            (kernel, kernel),
            (stride, stride),
            "VALID",
            conv_general_dilated=convolution.conv_general_dilated,
        )
        return nn.relu(layer(x))

    features = []
    for x, (kind, arg) in zip(jax.tree.leaves(obs), encoders, strict=True):
        if kind in ("nature", "grid") and arg == "chw":
            x = jnp.transpose(x, (0, 2, 3, 1))  # [B, C, H, W] -> [B, H, W, C]
        if kind == "nature":  # Mnih et al. 2015
            x = conv(conv(conv(x.astype(jnp.float32) / 255.0, 32, 8, 4), 64, 4, 2), 64, 3)
        # rl-starter-files' (torch-ac's) MiniGrid network: 2x2 convs, a max-pool
        elif kind == "grid":
            x = nn.max_pool(conv(x.astype(jnp.float32), 16, 2), (2, 2), (2, 2))
            x = conv(conv(x, 32, 2), 64, 2)
        else:
            x = (
                jax.nn.one_hot(x - arg[1], arg[0])
                if kind == "onehot"
                else x.astype(jnp.float32) * arg
            )
        features.append(x.reshape(x.shape[0], -1))
    return jnp.concatenate(features, axis=-1)


class Critic(nn.Module):
    """Q(s, a) [B]: `encode`d observation and the action, through a 256-256 ReLU MLP (CleanRL).
    K critics are one parameter tree with a leading axis of K (`critics`): TD3's and SAC's two,
    DDPG's one."""

    encoders: tuple

    @nn.compact
    def __call__(self, obs, action):
        x = jnp.concatenate([encode(obs, self.encoders), action], axis=-1)
        for size in [256, 256]:
            x = nn.relu(nn.Dense(size)(x))
        return nn.Dense(1)(x)[:, 0]


class Actor(nn.Module):
    """The deterministic policy: obs [B, ...] -> tanh(...) x scale + bias [B, A] (CleanRL)."""

    action_dim: int
    encoders: tuple
    scale: tuple
    bias: tuple

    @nn.compact
    def __call__(self, obs):
        x = encode(obs, self.encoders)
        for size in [256, 256]:
            x = nn.relu(nn.Dense(size)(x))
        return jnp.tanh(nn.Dense(self.action_dim)(x)) * jnp.asarray(self.scale) + jnp.asarray(
            self.bias
        )


# ---------------------------------------------------------------------------------------------
# Math (pure functions; tests import them)
# ---------------------------------------------------------------------------------------------


def smoothed_target_action(target_action, noise, noise_clip, scale, low, high):
    """TD3's target policy smoothing (Fujimoto et al. 2018, eq. 14): the target policy's action
    plus `noise` [B, A] (N(0, --target-noise)) clipped to [-noise_clip, noise_clip], both x the
    action scale, then clipped to the action bounds."""
    return jnp.clip(target_action + jnp.clip(noise, -noise_clip, noise_clip) * scale, low, high)


def critics(critic, q_params, obs, action):
    """Every critic's Q(s, a) [K, B], from parameters stacked on a leading axis of K."""
    return jax.vmap(critic.apply, in_axes=(0, None, None))(q_params, obs, action)


def td3_target(next_q, reward, discount):
    """The clipped double-Q target [B] (Fujimoto et al. 2018, eq. 10): reward + discount x
    min_k Q'_k(s', ã'); with one critic (K = 1) DDPG's reward + discount x Q'(s', μ'(s')).
    next_q: [K, B]; discount: gamma, or 0 after a termination."""
    return reward + discount * jnp.min(next_q, axis=0)


def policy_due(gradient_step, delay: int):
    """Whether gradient step `gradient_step` (counted over the run) also updates the policy and the
    targets: every `delay`-th, from the first (TD3's delayed updates, §5.2)."""
    return gradient_step % delay == 0


def n_step_return(rewards, terminated, truncated, gamma: float):
    """The n-step target's return and bootstrap discount of transitions from their next n rows
    ([..., n], Replay's): the rewards summed, each discounted, up to the first row that ends the
    episode; the discount gamma^k of the value k rows on, 0 after a termination. (SAC and TD3
    take one row: n is 1.)"""
    reward = np.zeros(rewards.shape[:-1], np.float32)
    discount = np.ones(rewards.shape[:-1], np.float32)
    alive = np.ones(rewards.shape[:-1], bool)
    for k in range(rewards.shape[-1]):
        reward += alive * discount * rewards[..., k]
        discount = np.where(alive, discount * gamma, discount)
        discount = np.where(alive & terminated[..., k], 0.0, discount)
        alive &= ~(terminated[..., k] | truncated[..., k])
    return reward, discount


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------


def make_policy_step(actor, noise, scale, low, high):
    """One jitted call per environment step of envs `env_ids` [B] at their `steps` [B] (each env's
    draws keyed by both and the thread's `key`): the policy's actions [B, A] plus N(0, `noise` x
    scale), clipped to the bounds, or uniform in them where `explore` (the first --learning-starts
    steps)."""

    @jax.jit
    def policy_step(params, obs, explore, key, env_ids, steps):
        keys = jax.vmap(jax.random.split)(env_keys(key, env_ids, steps, jnp))  # [B, 2, 2]
        action = actor.apply(params["actor"], obs)
        gaussian = jax.vmap(lambda k: jax.random.normal(k, action.shape[1:]))(keys[:, 0])
        action = jnp.clip(action + noise * scale * gaussian, low, high)
        uniform = jax.vmap(
            lambda k: jax.random.uniform(k, action.shape[1:], minval=low, maxval=high)
        )(keys[:, 1])
        return jnp.where(explore, uniform, action)

    return policy_step


def make_act(policy_step, args: Args, key):
    """One actor thread's behaviour policy, act(params, obs, env_ids, steps, first) -> (actions,
    None): uniform in the bounds for the run's first --learning-starts env steps (the envs' steps
    x the envs: as if they stepped in lockstep), the policy's after; each env's draws keyed by the
    thread's `key`, the env and its step. `first` (where an episode starts) is unused: the policy
    has no memory."""

    def act(params, obs, env_ids, steps, first):
        explore = int(steps.max()) * devices.global_envs(args) < args.learning_starts
        return policy_step(params, obs, np.bool_(explore), key, env_ids, steps), None

    return act


def acting_version(rollout: int, actor_lag, oldest: int) -> int:
    """The policy version that acts on rollout `rollout` (the replay scripts' chunk; counted over
    the run): the one the update on rollout `rollout - 1 - actor_lag` makes (Cleanba's actor at 1; 0
    the synchronous limit), and never one before `oldest`, the first the run holds (0; on resume the
    checkpoint's, or the oldest it carried: the resumed run acts with it until the schedule passes
    it). Sample Factory's free-running actor (None) waits for the first update alone, which compiles
    meanwhile (else the queue fills with rollouts of the initial parameters)."""
    return min(rollout, 1) if actor_lag is None else max(oldest, rollout - actor_lag)


def collect(envs, act, params, version: int, collecting, args: Args, shared, thread: int):
    """One chunk of --num-steps steps of every env, stepped a split at a time (Sample Factory's
    double buffering, §3.2: act on the split `recv()` returns while envpool steps the others; with
    --deterministic the next in turn), acted on with `params` (version `version`): the rows
    Replay.add takes, as envpool returned them with the action taken on each (replay.Chunk)."""
    timing = shared.timing
    for _ in range(args.num_steps * args.num_splits):
        start = time.perf_counter()
        obs, reward, terminated, truncated, info = envs.recv()
        now = time.perf_counter()
        timing["env"] += now - start
        env_ids, elapsed = info["env_id"], info["elapsed_step"]
        reward = np.where(elapsed > 0, reward, 0.0)  # a reset's: undefined (dm_control)
        steps = collecting.steps[env_ids]
        first = collecting.starts[env_ids]
        action, state = act(params, obs, env_ids + collecting.offset, steps, first)
        action = np.asarray(action)
        start = time.perf_counter()
        timing["inference"] += start - now
        envs.send(tasks.env_action(action, envs.action_space), env_ids)
        collecting.stats.update(env_ids, reward, terminated, truncated, info)
        tasks.check_legal(args, obs, env_ids, ~(terminated | truncated), elapsed)  # masks
        collecting.append(env_ids, obs, action, reward, terminated, truncated, elapsed, state)
        shared.sampled[thread] += len(env_ids)
        timing["bookkeeping"] += time.perf_counter() - start
    start = time.perf_counter()
    chunk = collecting.pop(version)
    timing["bookkeeping"] += time.perf_counter() - start
    return chunk


def actor_loop(envs, act, shared, chunk_queue, args: Args, num_chunks: int, device, thread, first):
    """rlpyt's asynchronous sampler: collect `num_chunks` chunks (from chunk `first` of the run)
    and queue them, blocking while the queue is full. Chunk m is acted on with the parameters
    `acting_version` names (exactly those with --deterministic), copied to this actor's `device`
    once per version."""
    collecting = Collecting(args.num_envs, thread * args.num_envs, first * args.num_steps)
    envs.async_reset()
    held = params = None  # held: the version of `params`
    for chunk_index in range(first, first + num_chunks):
        version = acting_version(chunk_index, args.actor_lag, shared.oldest)
        if not args.deterministic:  # free-running: never an update on a chunk not queued yet
            version = min(version, chunk_index)
        acting = shared.acting(version, args.deterministic)
        if acting is None:  # the run stops
            return
        if acting[1] != held:  # copied to this actor's device once per version
            latest, held = acting
            params = devices.to_actor(device, latest)
        chunk = collect(envs, act, params, held, collecting, args, shared, thread)
        start = time.perf_counter()
        if not threads.put(chunk_queue, chunk, shared.stop):
            return
        shared.timing["queue_put"] += time.perf_counter() - start


def evaluation_player(args: Args, built):
    """The evaluation's policy(params, obs, core, key, env_ids, steps) -> (actions, None, None,
    None): the deterministic policy, without exploration noise; its initial core (none).
    utils/evaluate.py calls it too."""
    (actor, _), _, _, _, _ = built

    @jax.jit
    def policy(params, obs, core, key, env_ids, steps):
        return actor.apply(params["actor"], obs), None, None, None

    return policy, lambda num_envs: None


# ---------------------------------------------------------------------------------------------
# Learning
# ---------------------------------------------------------------------------------------------


def make_gradient_steps(networks, optimizer, args: Args, bounds):
    """(critic_step, policy_step), each (state, batch, key) -> (state, diagnostics): one Adam step
    of the critics toward the smoothed, clipped target, and one of the policy with the targets'
    Polyak step."""
    (actor, critic), (scale, _, low, high) = networks, bounds

    def critic_step(state, batch, key):
        next_action = actor.apply(state["target_actor"], batch["next_obs"])
        noise = args.target_noise * jax.random.normal(key, next_action.shape)
        next_action = smoothed_target_action(next_action, noise, args.noise_clip, scale, low, high)
        next_q = critics(critic, state["target_q"], batch["next_obs"], next_action)
        target = jax.lax.stop_gradient(td3_target(next_q, batch["reward"], batch["discount"]))

        def loss(q_params):  # CleanRL: the sum of each critic's mean squared error
            q = critics(critic, q_params, batch["obs"], batch["action"])
            return jnp.sum(jnp.mean(jnp.square(q - target), axis=1)), q

        (q_loss, q), grads = jax.value_and_grad(loss, has_aux=True)(state["params"]["q"])
        updates, q_state = optimizer.update(grads, state["opt_state"]["q"], state["params"]["q"])
        params = dict(state["params"], q=optax.apply_updates(state["params"]["q"], updates))
        return dict(state, params=params, opt_state=dict(state["opt_state"], q=q_state)), {
            "qf_loss": q_loss,
            "q_values": q.mean(),
        }

    def policy_step(state, batch, key):

        def loss(
            actor_params,
        ):  # -Q_1(s, μ(s)): the deterministic policy gradient (Silver et al. 2014)
            q_params = jax.tree.map(lambda p: p[:1], state["params"]["q"])
            return -jnp.mean(
                critics(critic, q_params, batch["obs"], actor.apply(actor_params, batch["obs"]))
            )

        actor_loss, grads = jax.value_and_grad(loss)(state["params"]["actor"])
        updates, actor_state = optimizer.update(
            grads, state["opt_state"]["actor"], state["params"]["actor"]
        )
        params = dict(state["params"], actor=optax.apply_updates(state["params"]["actor"], updates))
        polyak = lambda p, t: args.tau * p + (1 - args.tau) * t  # noqa: E731
        return dict(
            state,
            params=params,
            opt_state=dict(state["opt_state"], actor=actor_state),
            target_actor=jax.tree.map(polyak, params["actor"], state["target_actor"]),
            target_q=jax.tree.map(polyak, params["q"], state["target_q"]),
        ), {"actor_loss": actor_loss}

    return critic_step, policy_step


def make_update(networks, optimizer, args: Args, bounds, mesh=None):
    """The jitted round: one gradient step on each of the `batches` [S, batch, ...] in turn, each
    a critic step, and every --policy-delay steps a policy step and the targets' Polyak step
    (TD3's delayed updates). Returns the state and the round's mean diagnostics."""
    critic_step, policy_step = make_gradient_steps(networks, optimizer, args, bounds)

    def step(state, batch_key):
        batch, key = batch_key
        if mesh is not None:  # each learner device takes its share of the batch: data parallel
            batch = jax.tree.map(
                lambda x: jax.lax.with_sharding_constraint(x, devices.split_envs(mesh, 0)), batch
            )
        state, diagnostics = critic_step(state, batch, key)
        due = policy_due(state["gradient_step"], args.policy_delay)
        state, policy_diagnostics = jax.lax.cond(
            due, policy_step, lambda s, b, k: (s, {"actor_loss": jnp.float32(0)}), state, batch, key
        )
        state = dict(state, gradient_step=state["gradient_step"] + 1)
        return state, dict(diagnostics, **policy_diagnostics, policy_step=due)

    @jax.jit
    def update(state, batches, key):
        keys = jax.random.split(key, jax.tree.leaves(batches)[0].shape[0])
        state, steps = jax.lax.scan(step, state, (batches, keys))
        diagnostics = {k: jnp.mean(v) for k, v in steps.items() if k in ("qf_loss", "q_values")}
        # the mean over the steps that updated the policy
        policy = jnp.maximum(jnp.sum(steps["policy_step"]), 1)
        diagnostics["actor_loss"] = jnp.sum(steps["actor_loss"]) / policy
        finite = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(state["params"])]
        diagnostics["finite"] = jnp.isfinite(diagnostics["qf_loss"]) & jnp.all(jnp.array(finite))
        return dict(state, policy_version=state["policy_version"] + 1), diagnostics

    return update


def learn_round(run, update, replay, chunks: list, rng, timing: dict):
    """The learner's round, the same in both modes: add each actor thread's chunk to the buffer
    (the learner owns it), then, once --learning-starts env steps are in (a resumed run refills
    its buffer first), sample the round's batches, compute their targets' rewards and discounts,
    learn from them with the round's own key (of its env step: a resumed run draws what the run
    would have); log the round. Returns the state."""
    args, state = run.args, run.state
    start = time.perf_counter()
    for chunk in chunks:
        replay.add(*chunk.rows)
    step = run.global_step + run.batch_size  # the env steps once this round is counted
    lag = [int(state["policy_version"]) - chunk.version for chunk in chunks]
    extra = {"async/policy_lag_mean": float(np.mean(lag)), "replay/fill": replay.fill}
    diagnostics = {"finite": True}
    if step > run.start_step + args.learning_starts:
        num_batches = gradient_steps(args)
        batches = replay.sample(args.batch_size, rng, 0.0, num_batches)
        batches.pop("slots")
        rows = [batches.pop(key) for key in ("rewards", "terminated", "truncated")]
        batches["reward"], batches["discount"] = n_step_return(*rows, args.gamma)
        now = time.perf_counter()
        timing["replay"] += now - start
        key = jax.random.fold_in(run.update_key, step)
        state, diagnostics = update(state, devices.to_learner(run.mesh, batches), key)
        diagnostics = jax.device_get(diagnostics)
        timing["update"] += time.perf_counter() - now
        sampled = num_batches * args.batch_size * sample_rows(args)
        extra["replay/ratio"] = sampled / run.batch_size
    else:
        state = dict(state, policy_version=state["policy_version"] + 1)
        timing["replay"] += time.perf_counter() - start
    diagnostics = dict(diagnostics, learning_rate=args.learning_rate)
    return run.learned(state, diagnostics, timing, extra)


def learner_loop(run, update, replay, shared, queues):
    """rlpyt's asynchronous optimiser: take one chunk from every actor thread's queue, in turn,
    learn the round, publish the parameters and their version: from run.start_update to
    run.num_updates, or until the run stops."""
    rng = np.random.default_rng(run.seed)
    shared.timing["replay"] = 0.0
    for _ in range(run.start_update, run.num_updates):
        start = time.perf_counter()
        chunks = [threads.get(q, run.stop) for q in queues]
        shared.timing["queue_get"] += time.perf_counter() - start
        games = [game for chunk in chunks if chunk for game in chunk.games]
        if run.should_stop(None in chunks, games):
            break
        state = learn_round(run, update, replay, chunks, rng, shared.timing)
        shared.publish(state["params"], int(state["policy_version"]))


def serial_loop(run, update, replay, shared, envs, acts, device):
    """rlpyt's serial mode (--serial): the same collection and round in one thread, in turn."""
    args, rng = run.args, np.random.default_rng(run.seed)
    shared.timing["replay"] = 0.0
    first_step = run.start_update * args.num_steps
    collecting = []
    for thread, env in enumerate(envs):
        collecting.append(Collecting(args.num_envs, thread * args.num_envs, first_step))
        env.async_reset()
    for _ in range(run.start_update, run.num_updates):
        params = devices.to_actor(device, run.state["params"])
        version = int(run.state["policy_version"])
        chunks = [
            collect(envs[i], acts[i], params, version, collecting[i], args, shared, i)
            for i in range(len(envs))
        ]
        if run.should_stop(False, [game for chunk in chunks for game in chunk.games]):
            break
        learn_round(run, update, replay, chunks, rng, shared.timing)


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def build(args: Args, key):
    """((actor, critic), optimizer, action bounds (scale, bias, low, high), normalizer, initial
    state) of a run with these flags; a checkpoint restores into `dict(state, **normalizer.state())`
    (utils/evaluate.py does too)."""
    obs_space, action_space = tasks.spaces(args.env_id)
    low, high = (np.asarray(x, np.float32) for x in (action_space.low, action_space.high))
    bounds = (
        (high - low) / 2,
        (high + low) / 2,
        low,
        high,
    )  # CleanRL's action_scale and action_bias
    actor = Actor(
        int(np.prod(action_space.shape)),
        tasks.encoders(obs_space),
        tuple(bounds[0].tolist()),
        tuple(bounds[1].tolist()),
    )
    critic = Critic(tasks.encoders(obs_space))
    obs, action = (
        tasks.zeros_like_space(obs_space, 1),
        np.zeros((1, *action_space.shape), np.float32),
    )
    actor_key, q_key = jax.random.split(key)
    params = {
        "actor": actor.init(actor_key, obs),
        "q": jax.vmap(critic.init, in_axes=(0, None, None))(
            jax.random.split(q_key, 1 + args.twin_q), obs, action
        ),
    }
    optimizer = optax.adam(args.learning_rate)
    normalizer = Normalizer(
        tasks.zeros_like_space(obs_space), devices.local_envs(args), False, False, args.gamma
    )
    opt_state = {"actor": optimizer.init(params["actor"]), "q": optimizer.init(params["q"])}
    state = {
        "params": params,
        "target_actor": params["actor"],
        "target_q": params["q"],
        "opt_state": opt_state,
        "gradient_step": 0,
        "global_step": 0,
        "policy_version": 0,
    }
    return (actor, critic), optimizer, bounds, normalizer, state


def make_replay(args: Args, obs_space, action_space):
    """The learner's buffer over all this process's envs (1-step transitions)."""
    return Replay(
        args.buffer_size,
        devices.local_envs(args),
        tasks.zeros_like_space(obs_space, 1),
        np.zeros((1, *action_space.shape), np.float32),
    )


def main(args: Args, given=None) -> int:
    """Train; return the exit code. `given`: the flags named on the command line, which replace a
    resumed run's own (None: those that differ from Args' defaults)."""
    if args.distributed:  # refused before the Run joins any process
        raise UsageError(
            "--distributed: td3_envpool.py learns in one process (its buffer is that process's)"
        )
    with runs.Run(args, given, __file__, resolve_args) as run:
        if run.finished:
            return 0
        args = run.args
        built = (actor, _), optimizer, bounds, normalizer, state = build(args, run.init_key)
        state = run.open(state, normalizer)
        actors = run.actors()  # (device, env seed, action key) of each actor thread
        envs = [
            tasks.make_actor_env(
                args.env_id,
                args.num_envs,
                seed,
                run.env_threads,
                args.num_splits,
                args.deterministic,
            )
            for _, seed, _ in actors
        ]
        policy_step = make_policy_step(actor, args.exploration_noise, bounds[0], *bounds[2:])
        shared = threads.Shared(
            state["params"],
            state["policy_version"],
            normalizer,
            run.sampled,
            run.stop,
            learning=not args.serial,
            keep=(args.actor_lag or 0) + 2,
        )
        acts = [make_act(policy_step, args, key) for _, _, key in actors]
        replay = make_replay(args, *tasks.spaces(args.env_id))
        update = make_update(built[0], optimizer, args, bounds, run.mesh)
        run.begin(
            f"{gradient_steps(args)} gradient steps a round{', serial' if args.serial else ''}",
            evaluation_player(args, built),
        )
        # The main thread waits: a signal stops the run within seconds whatever a thread does.
        if args.serial:
            device = actors[0][0]
            loop = run.threads.start(
                "training loop",
                serial_loop,
                run,
                update,
                replay,
                shared,
                envs,
                acts,
                device,
                owns=envs,
            )
            run.wait(loop)
            return run.finish()
        queues = [queue.Queue(maxsize=args.queue_size) for _ in actors]
        num_chunks = run.num_updates - run.start_update
        for i, (device, _, _) in enumerate(actors):
            run.threads.start(
                f"actor {i}" if i else "actor",
                actor_loop,
                envs[i],
                acts[i],
                shared,
                queues[i],
                args,
                num_chunks,
                device,
                i,
                run.start_update,
                owns=[envs[i]],
            )
        learner = run.threads.start("learner", learner_loop, run, update, replay, shared, queues)
        run.wait(learner)
        return run.finish()


if __name__ == "__main__":
    flags.command_line(main, Args, PRESETS)
