"""Synchronous PPO on envpool, in JAX: the baseline of Sample Factory's comparison.

Collect a rollout of `num_steps` steps from `num_envs` environments with the current policy,
then update on it (epochs x minibatches of PPO-clip with GAE), then collect again: sampling and
learning take turns, which is what `appo_envpool.py` changes (`diff` the two files).

References: Schulman et al. 2017 (PPO); Schulman et al. 2016 (GAE); Huang et al. 2022,
"The 37 implementation details of PPO" (CleanRL), whose names and Atari defaults are used here;
Petrenko et al. 2020, Sample Factory §4 (this is their synchronous PPO baseline).

Usage: python ppo_sync_baseline.py --env-id Pong-v5     (--help lists every flag)
"""

import dataclasses
import difflib
import json
import os
import signal
import sys
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Optional

import envpool
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from tensorboardX import SummaryWriter


@dataclass
class Args:
    """Synchronous PPO (collect, then update). Every size is in agent steps unless it says frames.

    Flags whose default shows as None take the preset of the task's family (Atari, classic
    control, MuJoCo; the PRESETS table in this file); config.json records the values used.
    """

    env_id: str = "Pong-v5"
    """envpool task id: Atari `*-v5` (84x84 grey, 4-frame stack, frame skip 4), classic control
    (CartPole-v1, Acrobot-v1, LunarLander-v2, ...) or MuJoCo (HalfCheetah-v4, Hopper-v4, ...)"""
    seed: int = 1
    """seed of the environments, the network initialisation and action sampling"""
    total_timesteps: int = 10_000_000
    """training budget in environment (agent) steps, summed over all environments"""
    num_envs: int = 8
    """number of parallel environments"""
    num_steps: Optional[int] = None
    """rollout length: steps per environment between two updates (default: preset, see PRESETS)"""
    learning_rate: Optional[float] = None
    """Adam learning rate, the start of the schedule when --anneal-lr (default: preset)"""
    anneal_lr: bool = True
    """decay the learning rate linearly to 0 over the run"""
    gamma: Optional[float] = None
    """discount factor (default: preset)"""
    gae_lambda: Optional[float] = None
    """lambda of generalised advantage estimation (default: preset)"""
    num_minibatches: Optional[int] = None
    """minibatches per epoch; must divide num_envs * num_steps (default: preset)"""
    update_epochs: Optional[int] = None
    """passes over each rollout (default: preset)"""
    norm_adv: bool = True
    """normalise advantages within each minibatch"""
    clip_coef: Optional[float] = None
    """PPO ratio clipping epsilon (default: preset)"""
    ent_coef: Optional[float] = None
    """weight of the entropy bonus (default: preset)"""
    vf_coef: float = 0.5
    """weight of the value loss"""
    max_grad_norm: float = 0.5
    """global gradient-norm clipping threshold"""
    num_threads: int = 0
    """envpool worker threads stepping the environments (0: one per CPU core, at most num_envs)"""
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """experiment name, part of the run folder's name"""
    run_dir: Optional[str] = None
    """output folder (default: runs/{env_id}__{exp_name}__{seed}__{timestamp})"""
    resume: Optional[str] = None
    """continue from this run folder or checkpoint file: parameters, optimiser state, step count"""
    save_interval: int = 50
    """write a checkpoint every this many updates (0: only at the end)"""
    log_frequency: int = 10
    """log losses, timings and SPS every this many updates and after the last (returns: always)"""
    eval_episodes: int = 10
    """episodes played with the final policy at the end of training (0: no evaluation)"""
    capture_video: bool = False
    """record an mp4 of one evaluation episode into {run_dir}/videos/"""
    track: bool = False
    """also log to Weights & Biases (needs `pip install wandb`)"""
    wandb_project: str = "jax-async-rl"
    """Weights & Biases project, with --track"""


# Defaults of the flags left at None, by environment family; an explicit flag always wins.
PRESETS = {
    # CleanRL's ppo_atari_envpool.py (Huang et al. 2022).
    "atari": dict(num_steps=128, learning_rate=2.5e-4, gamma=0.99, gae_lambda=0.95, num_minibatches=4,
                  update_epochs=4, clip_coef=0.1, ent_coef=0.01),
    # rl-baselines3-zoo's tuned CartPole-v1 PPO: solves it within 500k steps on every seed we tried.
    "classic": dict(num_steps=32, learning_rate=1e-3, gamma=0.98, gae_lambda=0.8, num_minibatches=1,
                    update_epochs=20, clip_coef=0.2, ent_coef=0.0),
    # CleanRL's ppo_continuous_action.py (2048 steps a rollout, minibatches of 64 at 8 envs).
    "mujoco": dict(num_steps=256, learning_rate=3e-4, gamma=0.99, gae_lambda=0.95, num_minibatches=32,
                   update_epochs=10, clip_coef=0.2, ent_coef=0.0),
}


# ---------------------------------------------------------------------------------------------
# Errors, validation, environment
# ---------------------------------------------------------------------------------------------


class UsageError(Exception):
    """A user's mistake: printed as one line, exit code 2, no traceback."""


def resolve_args(args: Args) -> Args:
    """Check the env id, fill the flags left at None from its family's preset, validate all.

    Raises UsageError before any environment or thread starts.
    """
    known = envpool.list_all_envs()
    if args.env_id not in known:
        close = difflib.get_close_matches(args.env_id, known, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see envpool.list_all_envs()"
        raise UsageError(f"--env-id {args.env_id!r} is not an envpool task{hint}")
    preset = PRESETS[env_kind(args.env_id)]
    args = dataclasses.replace(args, **{k: v for k, v in preset.items() if getattr(args, k) is None})
    for name in ["total_timesteps", "num_envs", "num_steps", "num_minibatches", "update_epochs", "log_frequency"]:
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ["learning_rate", "clip_coef", "max_grad_norm"]:
        if not getattr(args, name) > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ["num_threads", "save_interval", "eval_episodes", "ent_coef", "vf_coef"]:
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ["gamma", "gae_lambda"]:
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise UsageError(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name)}")
    batch_size = args.num_envs * args.num_steps
    if batch_size % args.num_minibatches:
        raise UsageError(
            f"--num-minibatches {args.num_minibatches} must divide --num-envs x --num-steps = {batch_size}"
        )
    if args.total_timesteps < batch_size:
        raise UsageError(f"--total-timesteps {args.total_timesteps} is less than one rollout ({batch_size} steps)")
    return args


def env_kind(env_id: str) -> str:
    """'atari', 'mujoco' or 'classic', read from the envpool spec without starting an env."""
    config = envpool.make_spec(env_id).config
    if hasattr(config, "episodic_life"):
        return "atari"
    return "mujoco" if hasattr(config, "xml_file") else "classic"


def make_env(env_id: str, num_envs: int, seed: int, num_threads: int, train: bool, **kwargs):
    """An envpool of `num_envs` environments (gymnasium API, auto-reset).

    For training, Atari games end an episode at each life lost and clip rewards to [-1, 1]
    (Mnih et al. 2015); the game score stays available in info["reward"] / info["terminated"].
    """
    if env_kind(env_id) == "atari":
        kwargs.update(episodic_life=train, reward_clip=train, noop_max=30)
    num_threads = num_threads or min(os.cpu_count() or 1, num_envs)
    return envpool.make(
        env_id, env_type="gymnasium", num_envs=num_envs, seed=seed, num_threads=num_threads, **kwargs
    )


class EpisodeStats:
    """Game scores per environment: unclipped rewards over the whole game (all lives)."""

    def __init__(self, num_envs: int):
        self.returns = np.zeros(num_envs, np.float64)
        self.finished = []  # (env, return, length) of games that ended since the last `pop`

    def update(self, env_ids, rewards, terminated, truncated, info):
        """Add one step of envs `env_ids`; a game ends at info["terminated"] (Atari) or term|trunc."""
        self.returns[env_ids] += info.get("reward", rewards)
        game_over = info.get("terminated", terminated) | truncated
        for i in np.flatnonzero(game_over):
            env = env_ids[i]
            self.finished.append((int(env), float(self.returns[env]), int(info["elapsed_step"][i])))
            self.returns[env] = 0.0

    def pop(self):
        finished, self.finished = self.finished, []
        return finished


# ---------------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------------


class ActorCritic(nn.Module):
    """Nature CNN trunk for images, separate 64-64 tanh MLPs for vectors (CleanRL).

    Returns `pi` [B, A] (logits, or mean and log-std concatenated [B, 2A] for Box actions)
    and `value` [B].
    """

    action_dim: int
    continuous: bool

    @nn.compact
    def __call__(self, obs):
        orth = nn.initializers.orthogonal
        if obs.ndim == 4:  # [B, C, H, W] uint8 frames
            x = jnp.transpose(obs, (0, 2, 3, 1)).astype(jnp.float32) / 255.0
            x = nn.relu(nn.Conv(32, (8, 8), (4, 4), padding="VALID", kernel_init=orth(np.sqrt(2)))(x))
            x = nn.relu(nn.Conv(64, (4, 4), (2, 2), padding="VALID", kernel_init=orth(np.sqrt(2)))(x))
            x = nn.relu(nn.Conv(64, (3, 3), (1, 1), padding="VALID", kernel_init=orth(np.sqrt(2)))(x))
            hidden = nn.relu(nn.Dense(512, kernel_init=orth(np.sqrt(2)))(x.reshape(x.shape[0], -1)))
            actor_hidden = critic_hidden = hidden
        else:
            x = obs.reshape(obs.shape[0], -1).astype(jnp.float32)
            actor_hidden, critic_hidden = x, x
            for _ in range(2):
                actor_hidden = nn.tanh(nn.Dense(64, kernel_init=orth(np.sqrt(2)))(actor_hidden))
                critic_hidden = nn.tanh(nn.Dense(64, kernel_init=orth(np.sqrt(2)))(critic_hidden))
        pi = nn.Dense(self.action_dim, kernel_init=orth(0.01))(actor_hidden)
        if self.continuous:
            log_std = self.param("log_std", nn.initializers.zeros, (self.action_dim,))
            pi = jnp.concatenate([pi, jnp.broadcast_to(log_std, pi.shape)], axis=-1)
        value = nn.Dense(1, kernel_init=orth(1.0))(critic_hidden)[:, 0]
        return pi, value


# ---------------------------------------------------------------------------------------------
# Math (pure functions; tests import them)
# ---------------------------------------------------------------------------------------------


def sample_action(pi, key, continuous: bool):
    """Sample actions [B] (discrete) or [B, A] (Gaussian, unclipped) from `pi`."""
    if continuous:
        mean, log_std = jnp.split(pi, 2, axis=-1)
        return mean + jnp.exp(log_std) * jax.random.normal(key, mean.shape)
    return jax.random.categorical(key, pi)


def log_prob_entropy(pi, actions, continuous: bool):
    """Log-probability of `actions` under `pi` and the policy's entropy, both [B]."""
    if continuous:
        mean, log_std = jnp.split(pi, 2, axis=-1)
        z = (actions - mean) / jnp.exp(log_std)
        logprob = jnp.sum(-0.5 * z**2 - log_std - 0.5 * jnp.log(2 * jnp.pi), axis=-1)
        entropy = jnp.sum(log_std + 0.5 * (1.0 + jnp.log(2 * jnp.pi)), axis=-1)
        return logprob, entropy
    log_p = jax.nn.log_softmax(pi)
    logprob = jnp.take_along_axis(log_p, actions[..., None].astype(jnp.int32), axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
    return logprob, entropy


def compute_gae(rewards, values, bootstrap_value, discounts, gae_lambda):
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16), time-major.

    rewards, values, discounts: [T, B] with discounts = gamma * (1 - done); bootstrap_value: [B],
    the value of the observation after the last step. Returns advantages [T, B].
    """
    next_values = jnp.concatenate([values[1:], bootstrap_value[None]], axis=0)
    deltas = rewards + discounts * next_values - values

    def backward(carry, x):
        delta, discount = x
        carry = delta + discount * gae_lambda * carry
        return carry, carry

    _, advantages = jax.lax.scan(backward, jnp.zeros_like(bootstrap_value), (deltas, discounts), reverse=True)
    return advantages


def time_limit_bootstrap(rewards, values, bootstrap_value, truncated, gamma):
    """Fold gamma * V(final obs) into the reward of steps cut by a time limit (Pardo et al. 2018).

    envpool shows the final observation of an episode on the following (reset) step, so its
    value is the next entry of `values` (or `bootstrap_value` after the last step). With this
    reward, `discounts = gamma * (1 - done)` may cut every episode end. Shapes as compute_gae.
    """
    next_values = jnp.concatenate([values[1:], bootstrap_value[None]], axis=0)
    return rewards + gamma * truncated * next_values


def masked_mean(x, mask):
    """Mean of `x` over the entries where `mask` is 1."""
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def ppo_loss(logprobs, old_logprobs, advantages, values, returns, entropy, mask, clip_coef, vf_coef, ent_coef):
    """PPO-clip surrogate (Schulman et al. 2017, eq. 7) + value regression - entropy bonus.

    All inputs are flat [N]; transitions with mask 0 do not count. Returns (loss, diagnostics).
    """
    log_ratio = logprobs - old_logprobs
    ratio = jnp.exp(log_ratio)
    pg_loss = masked_mean(jnp.maximum(-advantages * ratio, -advantages * jnp.clip(ratio, 1 - clip_coef, 1 + clip_coef)), mask)
    value_loss = 0.5 * masked_mean((values - returns) ** 2, mask)
    entropy_loss = masked_mean(entropy, mask)
    loss = pg_loss + vf_coef * value_loss - ent_coef * entropy_loss
    diagnostics = {
        "policy_loss": pg_loss,
        "value_loss": value_loss,
        "entropy": entropy_loss,
        "approx_kl": masked_mean((ratio - 1) - log_ratio, mask),
        "clipfrac": masked_mean((jnp.abs(ratio - 1) > clip_coef).astype(jnp.float32), mask),
    }
    return loss, diagnostics


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------


def make_policy_step(network, continuous: bool):
    """One jitted call per environment step: actions, their log-probabilities and values."""

    @jax.jit
    def policy_step(params, obs, key):
        key, subkey = jax.random.split(key)
        pi, value = network.apply(params, obs)
        action = sample_action(pi, subkey, continuous)
        logprob, _ = log_prob_entropy(pi, action, continuous)
        return action, logprob, value, key

    return policy_step


def env_action(action, action_space):
    """Gaussian actions are clipped to the action bounds before they reach the environment."""
    if hasattr(action_space, "n"):
        return action
    return np.clip(action, action_space.low, action_space.high)


def collect_rollout(envs, policy_step, params, obs, prev_dones, key, stats, args, timing):
    """Step all envs `num_steps` times with `params`; return the rollout, next obs, dones and key.

    The rollout is time-major [T, B, ...] host arrays plus `bootstrap_obs` [B, ...]. envpool
    resets an env on the step after its episode ends, ignoring that step's action: such steps
    get `valid` 0 and stay out of the loss. `truncated` marks time-limit ends, which bootstrap.
    """
    T, B = args.num_steps, args.num_envs
    rollout = {
        "obs": np.zeros((T, *obs.shape), obs.dtype),
        "actions": np.zeros((T, B, *envs.action_space.shape), envs.action_space.dtype),
        "logprobs": np.zeros((T, B), np.float32),
        "values": np.zeros((T, B), np.float32),
        "rewards": np.zeros((T, B), np.float32),
        "dones": np.zeros((T, B), np.float32),
        "truncated": np.zeros((T, B), np.float32),
        "valid": np.zeros((T, B), np.float32),
    }
    env_ids = np.arange(B)
    for t in range(T):
        start = time.perf_counter()
        action, logprob, value, key = policy_step(params, obs, key)
        action, logprob, value = jax.device_get((action, logprob, value))
        timing["inference"] += time.perf_counter() - start
        rollout["obs"][t], rollout["actions"][t] = obs, action
        rollout["logprobs"][t], rollout["values"][t] = logprob, value
        start = time.perf_counter()
        obs, reward, terminated, truncated, info = envs.step(env_action(action, envs.action_space))
        timing["env"] += time.perf_counter() - start
        rollout["valid"][t], prev_dones = 1.0 - prev_dones, terminated | truncated
        rollout["rewards"][t], rollout["dones"][t], rollout["truncated"][t] = reward, prev_dones, truncated
        stats.update(env_ids, reward, terminated, truncated, info)
    rollout["bootstrap_obs"] = obs
    return rollout, obs, prev_dones, key


# ---------------------------------------------------------------------------------------------
# Learning
# ---------------------------------------------------------------------------------------------


def make_optimizer(args: Args, num_updates: int):
    """Adam with global-norm clipping; the learning rate decays linearly per optimiser step."""
    steps_per_update = args.update_epochs * args.num_minibatches
    if args.anneal_lr:
        learning_rate = optax.linear_schedule(args.learning_rate, 0.0, num_updates * steps_per_update)
    else:
        learning_rate = args.learning_rate
    return optax.chain(
        optax.clip_by_global_norm(args.max_grad_norm), optax.adam(learning_rate, eps=1e-5)
    )


def make_update(network, optimizer, args: Args, continuous: bool):
    """The jitted learner step: GAE on the rollout, then epochs x minibatches of PPO-clip."""
    batch_size = args.num_envs * args.num_steps
    minibatch_size = batch_size // args.num_minibatches

    def loss_fn(params, mb):
        pi, values = network.apply(params, mb["obs"])
        logprobs, entropy = log_prob_entropy(pi, mb["actions"], continuous)
        advantages, mask = mb["advantages"], mb["valid"]
        if args.norm_adv:
            mean = masked_mean(advantages, mask)
            advantages = (advantages - mean) / (jnp.sqrt(masked_mean((advantages - mean) ** 2, mask)) + 1e-8)
        return ppo_loss(
            logprobs, mb["logprobs"], advantages, values, mb["returns"], entropy, mask,
            args.clip_coef, args.vf_coef, args.ent_coef,
        )

    def minibatch_step(carry, mb):
        params, opt_state = carry
        (loss, diagnostics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state), {"loss": loss, **diagnostics}

    @jax.jit
    def update(state, rollout, key):
        params, opt_state = state["params"], state["opt_state"]
        # XLA:CPU runs convolutions inside a loop ~10x slower than unrolled (measured on the
        # Nature CNN), so on CPU the scans over images are unrolled; elsewhere they stay loops.
        unroll = jax.default_backend() == "cpu" and rollout["obs"].ndim == 5
        values = rollout["values"]
        _, bootstrap_value = network.apply(params, rollout["bootstrap_obs"])
        rewards = time_limit_bootstrap(rollout["rewards"], values, bootstrap_value, rollout["truncated"], args.gamma)
        discounts = args.gamma * (1.0 - rollout["dones"])
        advantages = compute_gae(rewards, values, bootstrap_value, discounts, args.gae_lambda)
        data = {
            "obs": rollout["obs"],
            "actions": rollout["actions"],
            "logprobs": rollout["logprobs"],
            "valid": rollout["valid"],
            "advantages": advantages,
            "returns": advantages + rollout["values"],
        }
        data = jax.tree.map(lambda x: x.reshape(batch_size, *x.shape[2:]), data)

        def epoch(carry, key):
            order = jax.random.permutation(key, batch_size)
            minibatches = jax.tree.map(
                lambda x: x[order].reshape(args.num_minibatches, minibatch_size, *x.shape[1:]), data
            )
            return jax.lax.scan(minibatch_step, carry, minibatches, unroll=unroll)

        (params, opt_state), diagnostics = jax.lax.scan(
            epoch, (params, opt_state), jax.random.split(key, args.update_epochs), unroll=unroll
        )
        diagnostics = jax.tree.map(jnp.mean, diagnostics)
        leaves = jax.tree.leaves(params)
        diagnostics["finite"] = jnp.isfinite(diagnostics["loss"]) & jnp.all(
            jnp.array([jnp.all(jnp.isfinite(x)) for x in leaves])
        )
        new_state = dict(state, params=params, opt_state=opt_state, policy_version=state["policy_version"] + 1)
        return new_state, diagnostics

    return update


# ---------------------------------------------------------------------------------------------
# Logging and checkpoints
# ---------------------------------------------------------------------------------------------


class Logger:
    """TensorBoard events + metrics.jsonl ({"step", "wall_time", "tag", "value"} a line) + wandb."""

    def __init__(self, run_dir: str, args: Args):
        self.writer = SummaryWriter(run_dir)
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)
        self.wandb = None
        if args.track:
            import wandb

            self.wandb = wandb.init(project=args.wandb_project, config=vars(args), dir=run_dir, resume="allow")

    def log(self, step: int, scalars: dict):
        now = time.time()
        for tag, value in scalars.items():
            value = float(value)
            self.writer.add_scalar(tag, value, step, walltime=now)
            self.jsonl.write(json.dumps({"step": int(step), "wall_time": now, "tag": tag, "value": value}) + "\n")
        if self.wandb is not None:
            self.wandb.log(dict(scalars, global_step=step))

    def close(self):
        self.writer.close()
        self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()


def save_checkpoint(path: str, state: dict, args: Args):
    """Atomic write (temporary file, fsync, rename): a crash mid-write keeps the old checkpoint."""
    payload = {
        "state": flax.serialization.to_state_dict(jax.device_get(state)),
        "config": json.dumps(dataclasses.asdict(args)),
        "script": os.path.basename(__file__),
    }
    data = flax.serialization.msgpack_serialize(payload)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def checkpoint_path(resume: str) -> str:
    """`--resume` accepts a run folder or the checkpoint file itself."""
    return os.path.join(resume, "checkpoint.msgpack") if os.path.isdir(resume) else resume


def load_checkpoint(path: str, template: dict, args: Args) -> dict:
    """Restore a checkpoint into the structure of `template`; UsageError if it does not fit."""
    if not os.path.isfile(path):
        raise UsageError(f"--resume: no checkpoint at {path}; pass a run folder or its checkpoint.msgpack")
    try:
        with open(path, "rb") as f:
            payload = flax.serialization.msgpack_restore(f.read())
        config = json.loads(payload["config"])
        script, env_id = payload["script"], config["env_id"]
    except Exception as e:
        raise UsageError(f"--resume: {path} is not a readable checkpoint ({type(e).__name__}); it may be corrupt")
    if script != os.path.basename(__file__):
        raise UsageError(f"--resume: {path} was written by {script}, not {os.path.basename(__file__)}")
    if env_id != args.env_id:
        raise UsageError(f"--resume: the checkpoint is for --env-id {env_id}, not {args.env_id}")
    try:
        state = flax.serialization.from_state_dict(template, payload["state"])
        shapes_match = jax.tree.map(lambda a, b: np.shape(a) == np.shape(b), template, state)
    except Exception as e:
        raise UsageError(f"--resume: {path} does not match this network/optimiser ({e}); use the run's flags")
    if not all(jax.tree.leaves(shapes_match)):
        raise UsageError(f"--resume: {path} has parameters of other shapes; use the flags of the run that wrote it")
    return state


def evaluate(params, network, args: Args, continuous: bool, num_episodes: int, video_dir=None, greedy=False, signals=()):
    """Play `num_episodes` full games (no life loss ends, unclipped rewards); return the scores.

    Each env plays at most its share of the episodes, so that short games are not favoured.
    With `video_dir`, the first episode of the first env is written to an mp4 there. Stops early,
    with the scores so far and no video, once `signals` (the main thread's received signals) fills.
    """
    num_envs = min(num_episodes, 8)
    quota = np.full(num_envs, -(-num_episodes // num_envs))
    render = video_dir is not None and env_kind(args.env_id) != "mujoco"
    envs = make_env(
        args.env_id, num_envs, args.seed + 10_000, 1, train=False, **({"render_mode": "rgb_array"} if render else {})
    )

    @jax.jit
    def act(params, obs, key):
        pi, _ = network.apply(params, obs)
        if greedy:
            return (jnp.split(pi, 2, axis=-1)[0] if continuous else jnp.argmax(pi, -1)), key
        key, subkey = jax.random.split(key)
        return sample_action(pi, subkey, continuous), key

    key = jax.random.PRNGKey(args.seed + 10_000)
    stats = EpisodeStats(num_envs)
    obs, _ = envs.reset()
    scores, frames = [], []
    while len(scores) < num_episodes and not signals:
        if render and quota[0] == -(-num_episodes // num_envs):
            frames.append(envs.render()[0])
        action, key = act(params, obs, key)
        obs, reward, terminated, truncated, info = envs.step(env_action(np.asarray(action), envs.action_space))
        stats.update(np.arange(num_envs), reward, terminated, truncated, info)
        for env, ret, _ in stats.pop():
            if quota[env] > 0:
                scores.append(ret)
                quota[env] -= 1
    envs.close()
    if signals:
        return scores
    if render and frames:
        import imageio

        os.makedirs(video_dir, exist_ok=True)
        with warnings.catch_warnings():  # JAX warns of any fork; ffmpeg's fork + exec is safe
            warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
            imageio.mimsave(os.path.join(video_dir, "eval_episode_0.mp4"), frames, fps=30, macro_block_size=1)
    elif video_dir is not None:
        print("warning: MuJoCo rendering needs an OpenGL backend (set MUJOCO_GL); no video written", file=sys.stderr)
    return scores[:num_episodes]


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def main(args: Args) -> int:
    warnings.filterwarnings("ignore", message=".*precision lowered.*")  # gymnasium's Box casts
    args = resolve_args(args)
    batch_size = args.num_envs * args.num_steps
    num_updates = args.total_timesteps // batch_size
    kind = env_kind(args.env_id)
    spec = envpool.make_spec(args.env_id)
    action_space = spec.gymnasium_action_space if hasattr(spec, "gymnasium_action_space") else spec.action_space
    obs_space = spec.gymnasium_observation_space if hasattr(spec, "gymnasium_observation_space") else spec.observation_space
    continuous = not hasattr(action_space, "n")
    action_dim = int(np.prod(action_space.shape)) if continuous else int(action_space.n)

    network = ActorCritic(action_dim, continuous)
    key = jax.random.PRNGKey(args.seed)
    key, init_key, update_key = jax.random.split(key, 3)
    params = network.init(init_key, np.zeros((1, *obs_space.shape), obs_space.dtype))
    optimizer = make_optimizer(args, num_updates)
    state = {"params": params, "opt_state": optimizer.init(params), "global_step": 0, "policy_version": 0}
    if args.resume:
        state = load_checkpoint(checkpoint_path(args.resume), state, args)
        run_dir = args.run_dir or os.path.dirname(os.path.abspath(checkpoint_path(args.resume)))
    else:
        run_dir = args.run_dir or os.path.join("runs", f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}")
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(args), f, indent=2)
    ckpt_file = os.path.join(run_dir, "checkpoint.msgpack")

    stop = threading.Event()
    received = []

    def on_signal(signum, frame):
        received.append(signum)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    envs = make_env(args.env_id, args.num_envs, args.seed, args.num_threads, train=True)
    policy_step = make_policy_step(network, continuous)
    update = make_update(network, optimizer, args, continuous)
    logger = Logger(run_dir, args)
    stats = EpisodeStats(args.num_envs)
    recent_returns = deque(maxlen=20)
    obs, _ = envs.reset()
    dones = np.zeros(args.num_envs, bool)
    global_step = int(state["global_step"])
    start_update = int(state["policy_version"])
    print(f"{os.path.basename(__file__)}: {args.env_id} ({kind}), {num_updates} updates of {batch_size} steps -> {run_dir}")
    start_time, start_step, last_print = time.time(), global_step, 0.0
    timing = {"env": 0.0, "inference": 0.0, "update": 0.0}
    try:
        for update_idx in range(start_update, num_updates):
            if stop.is_set():
                break
            rollout, obs, dones, key = collect_rollout(envs, policy_step, state["params"], obs, dones, key, stats, args, timing)
            global_step += batch_size
            start = time.perf_counter()
            update_key, subkey = jax.random.split(update_key)
            new_state, diagnostics = update(state, rollout, subkey)
            diagnostics = jax.device_get(diagnostics)
            timing["update"] += time.perf_counter() - start
            if not diagnostics["finite"]:
                print(
                    f"error: non-finite loss or parameters at update {update_idx} (step {global_step}); "
                    f"{'the last good checkpoint is kept: ' + ckpt_file if os.path.exists(ckpt_file) else 'no checkpoint written'}. "
                    "Try a lower --learning-rate or --max-grad-norm.",
                    file=sys.stderr,
                )
                logger.close()
                return 1
            state = dict(new_state, global_step=global_step)
            for _, ret, length in stats.pop():
                recent_returns.append(ret)
                logger.log(global_step, {"charts/episodic_return": ret, "charts/episodic_length": length})
            sps = (global_step - start_step) / (time.time() - start_time)
            if (update_idx + 1) % args.log_frequency == 0 or update_idx + 1 == num_updates:
                scalars = {f"losses/{k}": v for k, v in diagnostics.items() if k != "finite"}
                scalars["charts/SPS"] = sps
                scalars["charts/learning_rate"] = (
                    args.learning_rate * (1 - (update_idx + 1) / num_updates) if args.anneal_lr else args.learning_rate
                )
                scalars.update({f"timing/{k}_seconds": v for k, v in timing.items()})
                logger.log(global_step, scalars)
            if args.save_interval and (update_idx + 1) % args.save_interval == 0:
                save_checkpoint(ckpt_file, state, args)
            if time.time() - last_print > 5 or update_idx + 1 == num_updates:
                last_print = time.time()
                mean_ret = f"{np.mean(recent_returns):.1f}" if recent_returns else "n/a"
                print(f"step {global_step:>10d}/{args.total_timesteps}  SPS {sps:7.0f}  return(last 20) {mean_ret}", flush=True)
    finally:
        envs.close()
    save_checkpoint(ckpt_file, state, args)
    if received:
        print(f"stopped by signal {received[0]} at step {global_step}; checkpoint: {ckpt_file}", file=sys.stderr)
        logger.close()
        return 128 + received[0]
    if recent_returns:
        print(f"final: mean return over the last {len(recent_returns)} episodes {np.mean(recent_returns):.2f}")
    if args.eval_episodes:
        video_dir = os.path.join(run_dir, "videos") if args.capture_video else None
        print(f"eval: playing {args.eval_episodes} episodes with the final policy", flush=True)
        scores = evaluate(state["params"], network, args, continuous, args.eval_episodes, video_dir, signals=received)
        if received:
            print(
                f"evaluation stopped by signal {received[0]} after {len(scores)} episodes; checkpoint: {ckpt_file}",
                file=sys.stderr,
            )
            logger.close()
            return 128 + received[0]
        logger.log(global_step, {"eval/episodic_return": np.mean(scores)})
        print(f"eval: {len(scores)} episodes, return {np.mean(scores):.2f} +- {np.std(scores):.2f}")
    logger.close()
    return 0


if __name__ == "__main__":
    cli_args = tyro.cli(Args)
    try:
        sys.exit(main(cli_args))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
