"""IMPALA on envpool, in JAX: the V-trace actor-critic (Espeholt et al. 2018) as TorchBeast
ships it (Küttler et al. 2019), on the asynchronous pipeline of `appo_envpool.py`.

Sampling and learning overlap (Petrenko et al. 2020, Sample Factory):
- double-buffered sampling (§3.2): one envpool of `num_splits` x `split_size` envs; while the
  jitted policy acts on the split that `recv()` returned, envpool's C++ threads step the others;
- an actor thread runs inference with the newest published parameters (§3.4) and stamps every
  transition with the policy version that chose it;
- a learner thread takes rollouts from a bounded queue and takes one RMSProp step of the IMPALA
  loss on V-trace targets, masking out transitions older than `max_policy_lag` versions (§3.4).

`diff appo_envpool.py impala_envpool.py` shows the loss, the optimiser and their flags.

Usage: python impala_envpool.py --env-id Pong-v5     (--help lists every flag)
"""

import dataclasses
import difflib
import functools
import hashlib
import importlib.util
import inspect
import itertools
import json
import os
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Annotated, Optional

if __name__ == "__main__":  # Ctrl-C while the libraries below import (seconds): exit 130, no traceback
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import envpool
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from jax.experimental import multihost_utils
from tensorboardX import SummaryWriter


# Flags left at None take the value of the task's preset (PRESETS below).
PRESET = tyro.conf.arg(help_behavior_hint="(default: preset)")
SPLITS = tyro.conf.arg(help_behavior_hint="(default: 2 with image observations, else 1)")


@dataclass
class Args:
    """IMPALA (actor and learner threads). Every size is in agent steps unless it says frames.

    Flags shown with "(default: preset)" take the value of the task's preset (listed below; the
    PRESETS table in this file); an explicit flag wins, and config.json records the values used.
    """

    env_id: str = "Pong-v5"
    """envpool task id of any single-agent family with Discrete or continuous actions: Atari `*-v5`,
    classic control, Box2D (CarRacing-v3), MuJoCo, dm_control (CheetahRun-v1), MiniGrid and BabyAI,
    MetaWorld, MyoSuite, Gymnasium-Robotics (FetchReach-v1), highway-env, gfootball, toy text, ..."""
    seed: int = 1
    """seed of the environments, the network initialisation and action sampling"""
    total_timesteps: int = 10_000_000
    """training budget in environment (agent) steps, summed over all environments"""
    num_envs: int = 8
    """number of parallel environments of each actor thread (see --num-actor-threads)"""
    num_splits: Annotated[Optional[int], SPLITS] = None
    """envpool splits for double-buffered sampling (Sample Factory §3.2); 1 disables it. It pays where
    stepping a split costs about one inference call and a core is free for it (Atari: 2 splits sample
    1.9x faster than 1); on vector tasks 1 split trained faster end to end on 2 cores (README)"""
    num_steps: Annotated[Optional[int], PRESET] = None
    """rollout length: steps per environment in each rollout"""
    queue_size: int = 2
    """rollouts the actor may queue ahead of the learner before it blocks (backpressure)"""
    max_policy_lag: int = 25
    """transitions chosen by a policy more than this many updates old are masked out of the loss"""
    vtrace_rho_bar: float = 1.0
    """V-trace clipping threshold of the importance ratio in the targets (rho bar)"""
    vtrace_c_bar: float = 1.0
    """V-trace clipping threshold of the trace-cutting coefficients (c bar)"""
    learning_rate: Annotated[Optional[float], PRESET] = None
    """RMSProp learning rate, the start of the schedule when --anneal-lr"""
    anneal_lr: bool = True
    """decay the learning rate linearly to 0 over the run"""
    gamma: Annotated[Optional[float], PRESET] = None
    """discount factor"""
    entropy_cost: Annotated[Optional[float], PRESET] = None
    """weight of the entropy bonus (TorchBeast: 0.0006)"""
    baseline_cost: float = 0.5
    """weight of the baseline (value) loss (TorchBeast's --baseline_cost)"""
    rmsprop_alpha: float = 0.99
    """RMSProp smoothing constant (TorchBeast's --alpha)"""
    rmsprop_eps: float = 0.01
    """RMSProp epsilon, added outside the square root as in PyTorch (TorchBeast's --epsilon)"""
    rmsprop_momentum: float = 0.0
    """RMSProp momentum (TorchBeast's --momentum)"""
    max_grad_norm: float = 40.0
    """global gradient-norm clipping threshold (TorchBeast's --grad_norm_clipping)"""
    norm_obs: Annotated[Optional[bool], PRESET] = None
    """True: normalise observations by a running mean and std, clipped to [-10, 10] (CleanRL, MuJoCo)"""
    norm_reward: Annotated[Optional[bool], PRESET] = None
    """True: divide rewards by the running std of the discounted return, clipped to [-10, 10]"""
    lstm: bool = False
    """an LSTM core between the encoder and the policy/value heads (TorchBeast's --use_lstm, Sample
    Factory's --use_rnn), its state carried per env and reset where an episode starts"""
    lstm_size: int = 128
    """hidden units of the LSTM, the size of its h and of its c (CleanRL's ppo_atari_lstm.py: 128)"""
    num_threads: int = 0
    """envpool worker threads of each actor thread (0: the CPU cores shared among the actor threads,
    at most num_envs)"""
    num_actor_threads: int = 1
    """actor threads on each actor device, each with num_envs envs and splits of its own; an update
    takes one rollout from each, so its global batch is processes x actor devices x actor threads x
    num_envs x num_steps env steps (config.json records it)"""
    xla_actor: bool = False
    """make each rollout with one jitted loop over envpool's XLA interface (recv, policy, the writes
    into the rollout, send), with no Python per env step: 2-3x the training SPS on vector and MuJoCo
    tasks on a 2-core CPU, about the same on Atari (README). The parameters are taken once per
    rollout; an actor that outruns the learner keeps the queue full, so the policy lag is then about
    --queue-size + 1 updates (masked beyond --max-policy-lag)"""
    actor_device_ids: list[int] = dataclasses.field(default_factory=lambda: [0])
    """this process's devices that run the policy for the envs (indices into jax.local_devices())"""
    learner_device_ids: list[int] = dataclasses.field(default_factory=lambda: [0])
    """this process's devices that hold the parameters, replicated, and share each update's batch
    along the env axis: the gradient is the mean over the global batch (XLA all-reduces it)"""
    distributed: bool = False
    """join the run's other processes through jax.distributed; each runs this command with its own
    envs; all update in lockstep and process 0 alone writes the run folder"""
    coordinator_address: str = ""
    """with --distributed: host:port of process 0 (empty: detected from the cluster, e.g. SLURM)"""
    num_processes: int = 0
    """with --distributed: the number of processes (0: detected from the cluster)"""
    process_id: int = -1
    """with --distributed: this process's index, 0 to num_processes - 1 (-1: detected)"""
    compile_cache: str = os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "jax-async-rl")
    """folder of JAX's persistent compilation cache: a later run of the same configuration skips most
    of XLA's compile (the Atari update's takes minutes on a CPU); '' turns it off"""
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """experiment name, part of the run folder's name"""
    run_dir: Annotated[Optional[str], tyro.conf.arg(help_behavior_hint="(default: runs/{env_id}__{exp_name}__{seed}__{time})")] = None
    """output folder; one that holds another run is refused (continue that one with --resume)"""
    resume: Optional[str] = None
    """continue this run folder (or checkpoint file) with its own flags; flags given here replace
    them, except --env-id, --norm-obs and --norm-reward, which cannot change mid-run"""
    save_interval: int = 50
    """write a checkpoint every this many updates (0: only at the end)"""
    log_frequency: int = 10
    """log losses, timings and SPS every this many updates and after the last (returns: always)"""
    eval_episodes: int = 10
    """episodes played with the final policy at the end of training (0: no evaluation)"""
    capture_video: bool = False
    """record an mp4 of one evaluation episode into {run_dir}/videos/"""
    track: bool = False
    """also log to Weights & Biases (needs `pip install wandb`, or the project's `wandb` extra)"""
    wandb_project: str = "jax-async-rl"
    """Weights & Biases project, with --track"""


# Defaults of the flags left at None: a task's own preset (by name, without its version), else its
# family's (env_kind); an explicit flag always wins. rl-baselines3-zoo's A2C settings carry over
# (5-step unrolls, RMSProp); its gSDE exploration (Pendulum) is not reproduced.
NO_NORM = dict(norm_obs=False, norm_reward=False)
PRESETS = {
    # TorchBeast's MonoBeast/PolyBeast Atari defaults: unrolls of 80 steps, batches of 8 unrolls.
    "atari": dict(num_steps=80, learning_rate=4.8e-4, gamma=0.99, entropy_cost=0.0006, **NO_NORM),
    # Cleanba's IMPALA settings with TorchBeast's optimiser, for continuous control, with CleanRL's
    # observation and reward normalisation.
    "mujoco": dict(num_steps=20, learning_rate=3e-4, gamma=0.99, entropy_cost=0.0, norm_obs=True, norm_reward=True),
    # Any other vector task: stable-baselines3's A2C defaults, a general starting point, not a tuned one.
    "classic": dict(num_steps=5, learning_rate=7e-4, gamma=0.99, entropy_cost=0.0, **NO_NORM),
    # rl-baselines3-zoo's A2C (hyperparams/a2c.yml). CartPole: with longer unrolls the critic fit
    # too slowly and runs collapsed on some seeds.
    "CartPole": dict(num_steps=5, learning_rate=7e-4, gamma=0.99, entropy_cost=0.0, **NO_NORM),
    "Acrobot": dict(num_steps=5, learning_rate=7e-4, gamma=0.99, entropy_cost=0.0, norm_obs=True, norm_reward=True),
    "MountainCar": dict(num_steps=5, learning_rate=7e-4, gamma=0.99, entropy_cost=0.0, norm_obs=True, norm_reward=True),
    "Pendulum": dict(num_steps=8, learning_rate=7e-4, gamma=0.9, entropy_cost=0.0, norm_obs=True, norm_reward=True),
    "LunarLander": dict(num_steps=5, learning_rate=8.3e-4, gamma=0.995, entropy_cost=1e-5, **NO_NORM),
    # The Control Suite: the continuous-control settings above.
    "dm_control": dict(num_steps=20, learning_rate=3e-4, gamma=0.99, entropy_cost=0.0, norm_obs=True, norm_reward=True),
    # MiniGrid and BabyAI: rl-starter-files' A2C (torch-ac; 5-step unrolls, RMSProp, lr 1e-3).
    "minigrid": dict(num_steps=5, learning_rate=1e-3, gamma=0.99, entropy_cost=0.01, **NO_NORM),
    # gfootball's frames as Atari's: TorchBeast's Atari settings.
    "gfootball": dict(num_steps=80, learning_rate=4.8e-4, gamma=0.99, entropy_cost=0.0006, **NO_NORM),
}


def describe_presets() -> str:
    """--help's description: the Args docstring and the values each preset gives."""
    lines = [f"  {name}: " + ", ".join(f"{k}={v}" for k, v in values.items()) for name, values in PRESETS.items()]
    return "\n".join([inspect.cleandoc(Args.__doc__), "", "Presets:", *lines])


# ---------------------------------------------------------------------------------------------
# Errors, validation, environment
# ---------------------------------------------------------------------------------------------


class UsageError(Exception):
    """A user's mistake: printed as one line, exit code 2, no traceback."""


def resolve_args(args: Args) -> Args:
    """Check the env id, fill the flags left at None from its preset, validate all.

    Raises UsageError before any environment or thread starts.
    """
    known = envpool.list_all_envs()
    if args.env_id not in known:
        close = difflib.get_close_matches(args.env_id, known, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see envpool.list_all_envs()"
        raise UsageError(f"--env-id {args.env_id!r} is not an envpool task{hint}")
    obs_space = check_task(args.env_id)
    preset = PRESETS[preset_name(args.env_id)]
    args = dataclasses.replace(args, **{k: v for k, v in preset.items() if getattr(args, k) is None})
    if args.num_splits is None:  # double buffering for the Nature CNN's images (see --num-splits)
        args = dataclasses.replace(args, num_splits=2 if "nature" in dict(encoders(obs_space)) else 1)
    if args.norm_obs and not any(np.issubdtype(s.dtype, np.floating) for s in jax.tree.leaves(space_tree(obs_space))):
        raise UsageError(f"--norm-obs is for float observations; {args.env_id} has none: pass --norm-obs False")
    if args.track and importlib.util.find_spec("wandb") is None:
        raise UsageError("--track logs to Weights & Biases, which is not installed: pip install wandb")
    for name in ["total_timesteps", "num_envs", "num_steps", "num_splits", "queue_size", "log_frequency", "lstm_size",
                 "num_actor_threads"]:
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ["learning_rate", "rmsprop_eps", "max_grad_norm", "vtrace_rho_bar", "vtrace_c_bar"]:
        if not getattr(args, name) > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ["num_threads", "save_interval", "eval_episodes", "entropy_cost", "baseline_cost", "max_policy_lag"]:
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ["gamma", "rmsprop_alpha", "rmsprop_momentum"]:
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise UsageError(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name)}")
    if args.num_envs % args.num_splits:
        raise UsageError(f"--num-splits {args.num_splits} must divide --num-envs {args.num_envs} "
                         "(left out, --num-splits is 2 with image observations, else 1)")
    if args.total_timesteps < global_envs(args) * args.num_steps:
        raise UsageError(f"--total-timesteps {args.total_timesteps} is less than one update ({describe_batch(args)})")
    return args


def local_envs(args: Args) -> int:
    """The envs of this process's actor threads, which make its share of every update's batch."""
    return len(args.actor_device_ids) * args.num_actor_threads * args.num_envs


def global_envs(args: Args) -> int:
    return jax.process_count() * local_envs(args)


def describe_batch(args: Args) -> str:
    """An update's batch, in words: processes x actor threads x num_envs x num_steps."""
    threads, processes = len(args.actor_device_ids) * args.num_actor_threads, jax.process_count()
    return (f"{processes} process{'es' * (processes > 1)} x {threads} actor thread{'s' * (threads > 1)} x "
            f"{args.num_envs} envs x {args.num_steps} steps "
            f"= {global_envs(args) * args.num_steps} env steps")


def check_task(env_id: str):
    """The observation space of a task these scripts can train on; else UsageError, one line."""
    try:
        spec = envpool.make_spec(env_id)
        obs_space, action_space = spaces(env_id)
    except Exception as e:  # e.g. Procgen without the system Qt 5 runtime: envpool's line gives the install command
        raise UsageError(f"--env-id {env_id} cannot be made here: {(str(e) or type(e).__name__).splitlines()[0]}")
    if spec.config.max_num_players > 1:
        raise UsageError(f"--env-id {env_id} is a {spec.config.max_num_players}-player task; these scripts train one agent")
    kind = type(action_space).__name__
    if not (kind == "Discrete" or kind == "Box" and np.issubdtype(action_space.dtype, np.floating)):
        raise UsageError(
            f"--env-id {env_id} has {action_space} actions (one discrete choice per dimension, as MultiDiscrete); "
            "these scripts take Discrete or continuous (float Box) actions"
        )
    for leaf in jax.tree.leaves(space_tree(obs_space)):
        if type(leaf).__name__ not in ("Box", "Discrete", "MultiBinary"):
            raise UsageError(f"--env-id {env_id} has {type(leaf).__name__} observations; these scripts take Box, "
                             "Discrete and MultiBinary observations and Dicts of them")
    return obs_space


# envpool's module of a task (envpool.mujoco.dmc, ...) -> the PRESETS family it takes.
FAMILIES = {"atari": "atari", "mujoco.dmc": "dm_control", "minigrid": "minigrid", "highway": "highway", "gfootball": "gfootball",
            "vizdoom": "vizdoom"}
# VizDoom's buttons as one Discrete action: envpool's default is a float Box over [DBL_MIN, DBL_MAX].
VIZDOOM = dict(use_combined_action=True)


def env_kind(env_id: str) -> str:
    """A task's family, from the envpool module that registers it: 'atari', 'dm_control',
    'minigrid' (and BabyAI), 'highway', 'gfootball', 'vizdoom', 'mujoco' (Gym MuJoCo, MetaWorld, MyoSuite,
    Gymnasium-Robotics, MuJoCo Playground) or 'classic' (any other: classic control, Box2D, ...)."""
    family = envpool.registration.registry.specs[env_id][0].removeprefix("envpool.")
    return FAMILIES.get(family, "mujoco" if family.startswith("mujoco") else "classic")


@functools.lru_cache(maxsize=None)
def spaces(env_id: str):
    """(observation space, action space) of a task, gymnasium's, from its spec without starting it."""
    spec = envpool.make_spec(env_id, **(VIZDOOM if env_kind(env_id) == "vizdoom" else {}))
    if hasattr(spec, "gymnasium_observation_space"):
        return spec.gymnasium_observation_space, spec.gymnasium_action_space
    return spec.observation_space, spec.action_space


def space_tree(space):
    """The observation pytree's structure with spaces as leaves: a Dict space becomes a dict (nested
    as envpool returns it), any other space is one leaf."""
    if type(space).__name__ == "Dict":
        return {key: space_tree(value) for key, value in space.spaces.items()}
    return space


def zeros_like_space(space, *batch):
    """An observation of zeros with leading dimensions `batch` (templates, network init)."""
    return jax.tree.map(lambda s: np.zeros((*batch, *s.shape), s.dtype), space_tree(space))


def preset_name(env_id: str) -> str:
    """The PRESETS entry of a task: its own (CartPole-v1 -> "CartPole"), else its family's, else classic."""
    name, kind = env_id.rsplit("-v", 1)[0], env_kind(env_id)
    return name if name in PRESETS else kind if kind in PRESETS else "classic"


def make_env(env_id: str, num_envs: int, seed: int, num_threads: int, train: bool, **kwargs):
    """An envpool of `num_envs` environments (gymnasium API, auto-reset).

    For training, Atari games end an episode at each life lost and clip rewards to [-1, 1]
    (Mnih et al. 2015); the game score stays available in info["reward"] / info["terminated"].
    """
    kind = env_kind(env_id)
    kwargs.update(dict(episodic_life=train, reward_clip=train, noop_max=30) if kind == "atari" else {})
    kwargs.update(VIZDOOM if kind == "vizdoom" else {})
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


class Normalizer:
    """Running normalisation of observations and rewards, as CleanRL's continuous-control PPO
    does it with gym's wrappers (Huang et al. 2022, continuous-action details 5-8): observations
    become (obs - mean) / sqrt(var + 1e-8), clipped to [-10, 10]; rewards are divided by the std
    of each env's discounted return, clipped to [-10, 10]. The statistics live on the host, move
    with training steps only and are checkpointed with the state; each is replaced whole, so
    another thread reads a consistent one, and actor threads update them one at a time. With both
    switches off it passes everything through.
    """

    def __init__(self, obs, num_envs: int, norm_obs: bool, norm_reward: bool, gamma: float):
        self.norm_obs, self.norm_reward, self.gamma = norm_obs, norm_reward, gamma
        zeros = jax.tree.map(lambda x: np.zeros(np.shape(x)), obs)  # `obs`: one observation (a pytree)
        self.obs_stats = (zeros, jax.tree.map(np.ones_like, zeros), 1e-4)  # mean, variance, count
        self.return_stats = (np.zeros(()), np.ones(()), 1e-4)
        self.returns = np.zeros(num_envs)  # discounted return of each env's episode so far
        self.lock = threading.Lock()

    @staticmethod
    def updated(stats, x):
        """(mean, variance, count) after adding the batch x [N, ...], a pytree (Chan et al.'s parallel
        update); one pass per leaf, plain ufuncs (np.var's wrapper cost the actor 10 µs a call)."""
        (mean, var, count), (leaves, tree) = stats, jax.tree.flatten(x)
        n = len(leaves[0])
        total, means, variances = count + n, [], []
        for leaf, m, v in zip(leaves, jax.tree.leaves(mean), jax.tree.leaves(var), strict=True):
            batch_mean = leaf.mean(0)
            delta = batch_mean - m
            batch_var = np.square(leaf - batch_mean).mean(0)
            means.append(m + delta * n / total)
            variances.append((v * count + batch_var * n + delta**2 * count * n / total) / total)
        return jax.tree.unflatten(tree, means), jax.tree.unflatten(tree, variances), total

    def observe(self, obs, train: bool = True):
        """Normalised observations [N, ...] (the float leaves; others pass); `train` also adds them to the statistics."""
        if not self.norm_obs:
            return obs
        if train:
            with self.lock:
                self.obs_stats = self.updated(self.obs_stats, obs)
        mean, var, _ = self.obs_stats
        return jax.tree.map(
            lambda x, m, v: np.minimum(np.maximum((x - m) / np.sqrt(v + 1e-8), -10), 10).astype(np.float32)
            if np.issubdtype(x.dtype, np.floating) else x, obs, mean, var,
        )

    def reward(self, reward, done, env_ids):
        """Scaled rewards [N] of envs `env_ids`; `done` ends their discounted returns."""
        if not self.norm_reward:
            return reward
        with self.lock:
            self.returns[env_ids] = self.returns[env_ids] * self.gamma + reward
            self.return_stats = self.updated(self.return_stats, self.returns[env_ids])
            self.returns[env_ids[done]] = 0.0
        return np.minimum(np.maximum(reward / np.sqrt(self.return_stats[1] + 1e-8), -10), 10).astype(np.float32)

    def state(self) -> dict:
        """{"norm": the statistics} to checkpoint with the state; {} when nothing is normalised."""
        if not (self.norm_obs or self.norm_reward):
            return {}
        names = ("mean", "var", "count")
        stats = {f"obs_{k}": jax.tree.map(np.asarray, v) for k, v in zip(names, self.obs_stats)}
        stats.update({f"return_{k}": np.asarray(v) for k, v in zip(names, self.return_stats)})
        return {"norm": stats}

    def load(self, state: dict):
        """Take the statistics out of a restored state (see `state`)."""
        stats = state.pop("norm", None)
        if stats is not None:
            self.obs_stats = tuple(jax.tree.map(np.asarray, stats[f"obs_{k}"]) for k in ("mean", "var", "count"))
            self.return_stats = tuple(np.asarray(stats[f"return_{k}"]) for k in ("mean", "var", "count"))


# ---------------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------------


def leaf_encoder(space) -> tuple:
    """How the network encodes one observation leaf, read from its space (no per-family tables).

    A rank-3 uint8 Box is an image. Its channels are the smaller of its first and last axes:
    Atari and VizDoom stack frames first, [C, H, W]; CarRacing, gfootball, MiniGrid and Procgen
    are [H, W, C] (a tie reads channels-last); either way the conv sees [B, H, W, C]. Images of at
    least 36x36 take the Nature CNN on pixels / 255 ("nature"); smaller grids, the MiniGrid
    literature's small conv on their raw symbolic codes ("grid"; from 7x7 up). A Discrete leaf is
    one-hot ("onehot", (n, start)). Anything else (float or integer Boxes of any rank, MultiBinary, smaller
    grids) is flattened to floats, uint8 scaled by 1/255 ("flat", scale).
    """
    name, shape = type(space).__name__, getattr(space, "shape", ())
    if name == "Discrete":
        return ("onehot", (int(space.n), int(space.start)))
    if name == "Box" and space.dtype == np.uint8 and len(shape) == 3:
        layout = "chw" if shape[0] < shape[-1] else "hwc"
        height, width = shape[1:] if layout == "chw" else shape[:2]
        if min(height, width) >= 36:
            return ("nature", layout)
        if min(height, width) >= 7:
            return ("grid", layout)
    return ("flat", 1 / 255 if space.dtype == np.uint8 else 1.0)


def encoders(obs_space) -> tuple:
    """leaf_encoder of every observation leaf, in the order of jax.tree.leaves(observation)."""
    return tuple(leaf_encoder(s) for s in jax.tree.leaves(space_tree(obs_space)))


class LSTMCore(nn.Module):
    """An LSTM over time-major inputs [T, B, F]; each env's state (c, h) [B, size] is reset to
    zeros before a step where its episode starts (`first` [T, B])."""

    size: int

    @functools.partial(nn.scan, variable_broadcast="params", split_rngs={"params": False})
    @nn.compact
    def __call__(self, state, inputs):
        x, first = inputs
        state = jax.tree.map(lambda s: jnp.where(first[:, None] > 0, 0.0, s), state)
        return nn.OptimizedLSTMCell(self.size)(state, x)


def zero_core(lstm_size: int, num_envs: int):
    """The network's `core` for `num_envs` envs before their first step: (state (c, h) of zeros
    [N, lstm_size], first [N] all True); None without an LSTM."""
    if not lstm_size:
        return None
    return (np.zeros((num_envs, lstm_size), np.float32), np.zeros((num_envs, lstm_size), np.float32)), np.ones(num_envs, bool)


class ActorCritic(nn.Module):
    """One encoder per observation leaf (`encoders`), concatenated into the trunk: with a Nature
    CNN leaf, a shared 512 ReLU layer (CleanRL's Atari network); otherwise separate 64-64 tanh
    MLPs for the policy and the value (CleanRL's vector network). A Box image or vector alone
    gives exactly those networks. With `lstm_size`, an LSTM (LSTMCore) sits between the encoders
    (and the 512 layer) and the heads.

    Feed-forward: obs [B, ...] -> `pi` [B, A] (logits, or mean and log-std concatenated [B, 2A]
    for Box actions), `value` [B], None. LSTM: `core` = (state, first) and obs [T, B, ...] with
    first [T, B] (T steps of each env from `state`; first [B] is one step, obs [B, ...]) ->
    pi [T, B, A], value [T, B] (or [B, A], [B]) and the state after the last step.
    """

    action_dim: int
    continuous: bool
    encoders: tuple  # leaf_encoder of each observation leaf
    lstm_size: int = 0  # 0: no LSTM

    @nn.compact
    def __call__(self, obs, core=None):
        orth = nn.initializers.orthogonal
        if self.lstm_size:
            state, first = core
            shape = first.shape  # [T, B], or [B] for one step
            first = first.reshape(-1, shape[-1])
            # Rows env-major [B x T, ...]: with the envs split over learner devices, each keeps its own.
            obs = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(*first.shape, *x.shape[len(shape):]), 0, 1).reshape(
                -1, *x.shape[len(shape):]), obs)

        def conv(x, size, kernel, stride=1):
            return nn.relu(nn.Conv(size, (kernel, kernel), (stride, stride), "VALID", kernel_init=orth(np.sqrt(2)))(x))

        features = []
        for x, (kind, arg) in zip(jax.tree.leaves(obs), self.encoders, strict=True):
            if kind in ("nature", "grid") and arg == "chw":
                x = jnp.transpose(x, (0, 2, 3, 1))  # [B, C, H, W] -> [B, H, W, C]
            if kind == "nature":  # Mnih et al. 2015
                x = conv(conv(conv(x.astype(jnp.float32) / 255.0, 32, 8, 4), 64, 4, 2), 64, 3)
            elif kind == "grid":  # rl-starter-files' (torch-ac's) MiniGrid network: 2x2 convs, a max-pool
                x = nn.max_pool(conv(x.astype(jnp.float32), 16, 2), (2, 2), (2, 2))
                x = conv(conv(x, 32, 2), 64, 2)
            else:
                x = jax.nn.one_hot(x - arg[1], arg[0]) if kind == "onehot" else x.astype(jnp.float32) * arg
            features.append(x.reshape(x.shape[0], -1))
        x = jnp.concatenate(features, axis=-1)
        nature = any(kind == "nature" for kind, _ in self.encoders)
        if nature:
            x = nn.relu(nn.Dense(512, kernel_init=orth(np.sqrt(2)))(x))
        if self.lstm_size:
            state, x = LSTMCore(self.lstm_size)(state, (jnp.swapaxes(x.reshape(*first.shape[::-1], -1), 0, 1), first))
            x = jnp.swapaxes(x, 0, 1).reshape(-1, self.lstm_size)
        if nature:
            actor_hidden = critic_hidden = x
        else:
            actor_hidden, critic_hidden = x, x
            for _ in range(2):
                actor_hidden = nn.tanh(nn.Dense(64, kernel_init=orth(np.sqrt(2)))(actor_hidden))
                critic_hidden = nn.tanh(nn.Dense(64, kernel_init=orth(np.sqrt(2)))(critic_hidden))
        pi = nn.Dense(self.action_dim, kernel_init=orth(0.01))(actor_hidden)
        if self.continuous:
            log_std = self.param("log_std", nn.initializers.zeros, (self.action_dim,))
            pi = jnp.concatenate([pi, jnp.broadcast_to(log_std, pi.shape)], axis=-1)
        value = nn.Dense(1, kernel_init=orth(1.0))(critic_hidden)[:, 0]
        if self.lstm_size:  # back to time-major
            pi, value = (jnp.swapaxes(y.reshape(*first.shape[::-1], *y.shape[1:]), 0, 1) for y in (pi, value))
            return pi.reshape(*shape, -1), value.reshape(shape), state
        return pi, value, None


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


def vtrace(
    log_rhos, discounts, rewards, values, bootstrap_value,
    clip_rho_threshold=1.0, clip_c_threshold=1.0, clip_pg_rho_threshold=1.0,
):
    """V-trace targets and policy-gradient advantages (Espeholt et al. 2018, eq. 1 and §4.2).

    log_rhos = log pi(a|x) - log mu(a|x), discounts, rewards, values: [T, B]; bootstrap_value: [B].
    Returns (vs, pg_advantages), both [T, B], with gradients stopped.
    """
    rhos = jnp.exp(log_rhos)
    clipped_rhos = jnp.minimum(clip_rho_threshold, rhos)
    cs = jnp.minimum(clip_c_threshold, rhos)
    next_values = jnp.concatenate([values[1:], bootstrap_value[None]], axis=0)
    deltas = clipped_rhos * (rewards + discounts * next_values - values)

    def backward(carry, x):
        delta, discount, c = x
        carry = delta + discount * c * carry
        return carry, carry

    _, vs_minus_v = jax.lax.scan(backward, jnp.zeros_like(bootstrap_value), (deltas, discounts, cs), reverse=True)
    vs = vs_minus_v + values
    next_vs = jnp.concatenate([vs[1:], bootstrap_value[None]], axis=0)
    pg_advantages = jnp.minimum(clip_pg_rho_threshold, rhos) * (rewards + discounts * next_vs - values)
    return jax.lax.stop_gradient(vs), jax.lax.stop_gradient(pg_advantages)


def time_limit_bootstrap(rewards, values, bootstrap_value, truncated, gamma):
    """Fold gamma * V(final obs) into the reward of steps cut by a time limit (Pardo et al. 2018).

    envpool shows the final observation of an episode on the following (reset) step, so its
    value is the next entry of `values` (or `bootstrap_value` after the last step). With this
    reward, `discounts = gamma * (1 - done)` may cut every episode end. Shapes as vtrace.
    """
    next_values = jnp.concatenate([values[1:], bootstrap_value[None]], axis=0)
    return rewards + gamma * truncated * next_values


def learning_rate_at(args: Args, global_step):
    """Learning rate of the update that starts at env step `global_step`: with --anneal-lr it falls
    linearly to 0 at --total-timesteps (CleanRL). A function of steps, not of an optimiser count,
    so a resumed run continues its schedule, also with another budget or batch size."""
    if not args.anneal_lr:
        return args.learning_rate
    return args.learning_rate * jnp.clip(1.0 - global_step / args.total_timesteps, 0.0, 1.0)


def masked_mean(x, mask):
    """Mean of `x` over the entries where `mask` is 1."""
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def impala_loss(logprobs, pg_advantages, values, vs, entropy, mask, baseline_cost, entropy_cost):
    """IMPALA's actor-critic loss (Espeholt et al. 2018, §4), summed over transitions as in TorchBeast.

    Policy gradient weighted by the V-trace advantage, baseline regression towards the V-trace
    targets `vs`, entropy bonus. Inputs [T, B]; transitions with mask 0 do not count.
    Returns (loss, diagnostics).
    """
    pg_loss = -jnp.sum(logprobs * pg_advantages * mask)
    value_loss = 0.5 * jnp.sum((vs - values) ** 2 * mask)
    entropy_sum = jnp.sum(entropy * mask)
    loss = pg_loss + baseline_cost * value_loss - entropy_cost * entropy_sum
    diagnostics = {"policy_loss": pg_loss, "value_loss": value_loss, "entropy": masked_mean(entropy, mask)}
    return loss, diagnostics


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------


def make_policy_step(network, continuous: bool, values: bool = True):
    """One jitted call per environment step: actions, their log-probabilities, values (None with
    `values` False: XLA then skips the critic, a third of a small MLP's acting time), the recurrent
    state after the step (`core`: see ActorCritic; None without --lstm) and the key."""

    @jax.jit
    def policy_step(params, obs, core, key):
        key, subkey = jax.random.split(key)
        pi, value, state = network.apply(params, obs, core)
        action = sample_action(pi, subkey, continuous)
        logprob, _ = log_prob_entropy(pi, action, continuous)
        return action, logprob, value if values else None, state, key

    return policy_step


def write(tree, index, values, rows=...):
    """tree[index] = values[rows], leaf by leaf: observations are pytrees of host arrays."""
    for buffer, value in zip(jax.tree.leaves(tree), jax.tree.leaves(values), strict=True):
        buffer[index] = value[rows]


def env_action(action, action_space):
    """Gaussian actions are clipped to the action bounds before they reach the environment."""
    if hasattr(action_space, "n"):
        return action
    return np.clip(action, action_space.low, action_space.high)


class Shared:
    """What the threads share: the newest parameters and their version, the normaliser, counts,
    stop, errors, reports."""

    def __init__(self, state, normalizer=None, stop=None, started=None, received=None, actors=1):
        self.state = state  # the learner's last good state, for checkpoints
        self.normalizer = normalizer or Normalizer(np.zeros(()), 0, False, False, 0.0)  # the actors'; checkpointed
        self.sampled = np.zeros(actors, np.int64)  # env steps each actor thread has sent actions for, this session
        self.received = [] if received is None else received  # the signals received (Signals'), for `agree`
        self.episodes = deque()  # with many processes: finished games, gathered by the learner (`agree`)
        self.started = started or threading.Event()  # set by the first update (Signals reads it)
        self.latest = (state["params"], int(state["policy_version"]))  # replaced whole: atomic
        self.stop = stop or threading.Event()  # set by Signals, an error, or the end
        self.errors = []  # (thread name, exception, formatted traceback)
        self.reports = queue.Queue()  # (env steps, {tag: value}) for the main thread's logger
        self.timing = dict.fromkeys(["env", "inference", "bookkeeping", "device_get", "queue_put", "queue_get", "update"], 0.0)

    def report_episodes(self, step: int, episodes: list):
        """The (env, return, length) of games an actor finished: for the main thread's logs, or
        with many processes for the learner, which gathers those of all (`agree`)."""
        if jax.process_count() > 1:
            self.episodes.extend(episodes)
        else:
            self.reports.put((step, {"episodes": episodes}))


def start_thread(name, fn, shared, *args):
    """Run fn(*args) in a thread; an exception is recorded and stops every thread."""

    def target():
        try:
            fn(*args)
        except BaseException as e:
            shared.errors.append((name, e, traceback.format_exc()))
            shared.stop.set()

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def join_threads(threads, envs):
    """Wait for the stopped threads, one deadline for all (a thread stuck in XLA is left to
    os._exit; with many processes, the learner may first finish an update and agree with the
    others to stop); close the envs of the actors that ended (`envs[i]`: `threads[i]`'s)."""
    deadline = time.time() + (5 if jax.process_count() == 1 else 60)
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.time()))
    for thread, env in zip(threads, envs):
        if not thread.is_alive():
            env.close()


def put(q, item, stop) -> bool:
    """queue.put that gives up when `stop` is set: no call waits forever."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            pass
    return False


def get(q, stop):
    """queue.get that returns None when `stop` is set: no call waits forever."""
    while not stop.is_set():
        try:
            return q.get(timeout=0.1)
        except queue.Empty:
            pass
    return None


def new_rollout(T: int, B: int, obs, action_space, memory=None) -> dict:
    """Empty host buffers of one rollout, time-major [T, B, ...]; `obs`: a batch of observations;
    `memory`: with --lstm, the recurrent states of the B envs, recorded at row 0 ("state")."""
    fields = ["logprobs", "rewards", "dones", "truncated", "valid"] + ["first"] * (memory is not None)
    rollout = {name: np.zeros((T, B), np.float32) for name in fields}
    if memory is not None:
        rollout["state"] = jax.tree.map(np.zeros_like, memory)
    rollout["actions"] = np.zeros((T, B, *action_space.shape), action_space.dtype)
    rollout["policy_version"] = np.zeros((T, B), np.int32)
    rollout["obs"] = jax.tree.map(lambda x: np.zeros((T, B, *x.shape[1:]), x.dtype), obs)
    rollout["bootstrap_obs"] = jax.tree.map(lambda x: np.zeros((B, *x.shape[1:]), x.dtype), obs)
    return rollout


def rollouts_at(buffers, index, env_ids, T: int, new) -> list:
    """[(k, buffers[k], rows, env ids, selection)] for the rollouts k = index // T that the env
    steps `index` of `env_ids` fall in: one rollout and no masks in the common case (no
    np.unique); `new()` makes the buffers of a rollout not in `buffers` yet."""
    k = index // T
    if not len(k) or k.min() == k.max():
        ks, selections = k[:1].tolist(), [slice(None)]
    else:
        ks = np.unique(k).tolist()
        selections = [k == n for n in ks]
    for n in ks:
        if n not in buffers:
            buffers[n] = new()
    return [(n, buffers[n], index[sel] - n * T, env_ids[sel], sel) for n, sel in zip(ks, selections)]


def actor_loop(envs, policy_step, shared, rollout_queue, key, args, num_rollouts, start_step, device=None, thread=0):
    """Double-buffered sampling (Sample Factory §3.2): act on the split `recv()` returns while
    envpool steps the others; queue `num_rollouts` rollouts. Env e's n-th step goes to rollout
    n // T, row n % T, column e, in any order envpool returns envs; a rollout is queued once every
    env has delivered the observation after its last row (`bootstrap_obs`). The step after an
    episode's end only resets the env (its action is ignored): `valid` 0. With --lstm, `memory`
    holds each env's state by env id, reset where an episode starts; a rollout records the states
    before its row 0 (Sample Factory's choice: no burn-in). Thread `thread` acts on `device`."""
    T, B = args.num_steps, args.num_envs
    steps, prev_dones = np.zeros(B, np.int64), np.zeros(B, bool)  # actions sent so far, per env
    buffers, bootstrapped, pushed = {}, {}, 0  # rollouts being filled, by number, and their bootstrap counts
    stats, timing = EpisodeStats(B), shared.timing
    memory = zero_core(args.lstm_size, B)[0] if args.lstm else None  # (c, h) [B, lstm_size], by env id
    core = held = params = None  # held: the version of `params`

    def rollouts_of(index, env_ids):  # ... and a new rollout's buffers take the current obs' shapes
        return rollouts_at(buffers, index, env_ids, T, lambda: new_rollout(T, B, obs, envs.action_space, memory))

    envs.async_reset()
    while pushed < num_rollouts and not shared.stop.is_set():
        start = time.perf_counter()
        obs, reward, terminated, truncated, info = envs.recv()
        timing["env"] += (now := time.perf_counter()) - start
        env_ids, index = info["env_id"], steps[info["env_id"]]
        reward = np.where(info["elapsed_step"] > 0, reward, 0.0)  # a reset's reward is undefined (dm_control: NaN at times)
        obs = shared.normalizer.observe(obs)
        if memory is not None:  # the envs' states, and which observations start an episode
            core = jax.tree.map(lambda s: s[env_ids], memory), prev_dones[env_ids] | (index == 0)
        latest, version = shared.latest  # fast weight sync (§3.4): newest parameters every call,
        if version != held:  # copied to this actor's device once per update
            held, params = version, to_actor(device, latest)
        action, logprob, _, state, key = policy_step(params, obs, core, key)  # dispatched asynchronously,
        timing["inference"] += (start := time.perf_counter()) - now  # so the bookkeeping below overlaps it

        stats.update(env_ids, reward, terminated, truncated, info)  # game scores: raw rewards
        done = terminated | truncated
        reward = shared.normalizer.reward(reward, done, env_ids + thread * B)
        s = slice(None) if index.all() else index > 0  # the envs a step returned (not a first observation)
        prev_dones[env_ids[s]] = done[s]
        for _, buf, rows, ids, sel in rollouts_of(index[s] - 1, env_ids[s]):  # that step's row
            buf["rewards"][rows, ids], buf["truncated"][rows, ids], buf["dones"][rows, ids] = (
                reward[s][sel], truncated[s][sel], done[s][sel])
        ends = (index % T == 0) & (index > 0)
        for n, buf, _, ids, sel in rollouts_of(index[ends] - T, env_ids[ends]) if ends.any() else []:
            write(buf["bootstrap_obs"], ids, jax.tree.map(lambda x: x[ends], obs), sel)
            bootstrapped[n] = bootstrapped.get(n, 0) + len(ids)
        current = rollouts_of(index, env_ids)
        valid = 1.0 - prev_dones[env_ids]
        for _, buf, rows, ids, sel in current:
            write(buf["obs"], (rows, ids), obs, sel)
            buf["valid"][rows, ids], buf["policy_version"][rows, ids] = valid[sel], version
            if memory is not None:
                buf["first"][rows, ids] = core[1][sel]
                write(buf["state"], ids[rows == 0], jax.tree.map(lambda x: x[sel][rows == 0], core[0]))
        timing["bookkeeping"] += (now := time.perf_counter()) - start

        action, logprob, state = jax.device_get((action, logprob, state))
        timing["device_get"] += (start := time.perf_counter()) - now
        if memory is not None:
            write(memory, env_ids, state)
        envs.send(env_action(action, envs.action_space), env_ids)
        for _, buf, rows, ids, sel in current:
            buf["actions"][rows, ids], buf["logprobs"][rows, ids] = action[sel], logprob[sel]
        steps[env_ids] += 1
        shared.sampled[thread] += len(env_ids)
        timing["bookkeeping"] += time.perf_counter() - start

        while pushed < num_rollouts and buffers and bootstrapped.get(min(buffers)) == B:
            del bootstrapped[min(buffers)]
            rollout = buffers.pop(min(buffers))
            shared.report_episodes(start_step + int(shared.sampled.sum()), stats.pop())
            start = time.perf_counter()
            if not put(rollout_queue, rollout, shared.stop):
                return
            timing["queue_put"] += time.perf_counter() - start
            pushed += 1


XLA_RING = 2  # --xla-actor: rollouts in the first ring (it doubles when an env runs further ahead)


def make_xla_rollout(envs, policy_step, args):
    """--xla-actor: `collect(R)(carry, params, version)` runs recv, the policy, the writes into the
    rollout and send as one jitted loop over envpool's XLA interface (`envs.xla()`, as CleanRL's
    envpool-XLA PPO), with no Python per env step, until the oldest rollout is complete. It
    returns (carry, that rollout, whether it is complete, the games ended, their count). Env e's
    n-th step goes to row n % T of rollout n // T, as actor_loop places it, in a ring of R
    rollouts: an env that has finished its rollout is still sent actions (recv waits for a full
    split), into the next ones. The loop stops short (complete False) before an env would write R
    rollouts ahead of the oldest; `grown` then doubles R. `init(key, R)`: the first carry; its
    "norm": see xla_normalize."""
    T, B = args.num_steps, args.num_envs
    space = envs.action_space
    x64 = np.float64 in [s.dtype for s in jax.tree.leaves(space_tree(envs.observation_space)) + [space]]
    with jax.enable_x64(x64):  # envpool's XLA interface passes float64 (MuJoCo) as it is: so must JAX, in this thread
        handle, recv, send, _ = envs.xla()
    first = f32(zeros_like_space(envs.observation_space, 1))
    memory = zero_core(args.lstm_size, B)[0] if args.lstm else None  # (c, h) [B, lstm_size], by env id

    def init(key, R):
        ring = {"bootstrapped": np.zeros((B,), bool), **new_rollout(T, B, first, space, memory)}
        return {"handle": handle, "key": key, "steps": np.zeros(B, np.int32), "prev_dones": np.zeros(B, bool),
                "returns": np.zeros(B, np.float32), "ring": jax.tree.map(lambda x: np.stack([x] * R), ring),
                "count": np.int32(0), "oldest": np.int32(0), "norm": None,
                "norm_returns": np.zeros(B, np.float32), "memory": memory}

    def body(R, params, version, c):
        c, ring = dict(c), dict(c["ring"])
        c["handle"], (obs, reward, terminated, truncated, info) = recv(c["handle"])
        obs, ids, n = f32(obs), info["env_id"], c["steps"][info["env_id"]]
        reward = jnp.where(info["elapsed_step"] > 0, reward, 0.0)  # a reset's reward is undefined
        c, done = xla_games(c, ids, reward, terminated, truncated, info), terminated | truncated
        c, obs, reward = xla_normalize(c, obs, reward, done, ids, args)
        core = None if memory is None else (  # --lstm: the envs' states; which observations start an episode
            jax.tree.map(lambda m: m[ids], c["memory"]), c["prev_dones"][ids] | (n == 0))
        ended = n > 0  # the observation ends env step n - 1: its reward and dones
        c["prev_dones"] = c["prev_dones"].at[ids].set(jnp.where(ended, done, c["prev_dones"][ids]))
        slot, row = jnp.where(ended, (n - 1) // T % R, R), (n - 1) % T  # R: dropped
        for name, x in (("rewards", reward), ("truncated", truncated), ("dones", done)):
            ring[name] = ring[name].at[slot, row, ids].set(x.astype(ring[name].dtype), mode="drop")
        slot = jnp.where(ended & (n % T == 0), slot, R)  # ... and is the bootstrap_obs of its rollout
        ring["bootstrap_obs"] = jax.tree.map(lambda b, x: b.at[slot, ids].set(x, mode="drop"), ring["bootstrap_obs"], obs)
        ring["bootstrapped"] = ring["bootstrapped"].at[slot, ids].set(True, mode="drop")
        action, logprob, _, state, c["key"] = policy_step(params, obs, core, c["key"])
        action = f32(action)  # as the env gets it (the policy samples float64 under x64)
        slot, row = n // T % R, n % T  # env step n
        ring["obs"] = jax.tree.map(lambda b, x: b.at[slot, row, ids].set(x), ring["obs"], obs)
        stamps = {"valid": 1.0 - c["prev_dones"][ids], "policy_version": version, "actions": action, "logprobs": logprob}
        for name, x in dict(stamps, **({} if core is None else {"first": core[1]})).items():
            ring[name] = ring[name].at[slot, row, ids].set(jnp.asarray(x, ring[name].dtype))
        if core is not None:  # a rollout records the states before its row 0 (as actor_loop)
            start = jnp.where(row == 0, slot, R)
            ring["state"] = jax.tree.map(lambda b, x: b.at[start, ids].set(x, mode="drop"), ring["state"], core[0])
            c["memory"] = jax.tree.map(lambda m, x: m.at[ids].set(x), c["memory"], state)
        action = action.astype(jnp.int32) if hasattr(space, "n") else jnp.clip(action, space.low, space.high).astype(space.dtype)
        c["handle"], c["steps"] = send(c["handle"], action, ids), c["steps"].at[ids].add(1)
        return dict(c, ring=ring)

    @functools.cache
    def collect(R):
        def running(c):  # the oldest rollout lacks a bootstrap_obs, and no env's next step would leave the ring
            return ~c["ring"]["bootstrapped"][c["oldest"] % R].all() & (c["steps"].max() < (c["oldest"] + R) * T)

        @functools.partial(jax.jit, donate_argnums=0)
        def call(carry, params, version):
            games = {k: jnp.zeros(R * T * B, dtype) for k, dtype in [("env", int), ("return", float), ("length", int)]}
            carry = jax.lax.while_loop(running, functools.partial(body, R, params, version), dict(carry, count=0, games=games))
            slot, ring, games = carry["oldest"] % R, dict(carry["ring"]), carry.pop("games")  # a call ends < R T B games
            rollout = {k: jax.tree.map(lambda x: x[slot], v) for k, v in ring.items() if k != "bootstrapped"}
            complete = ring["bootstrapped"][slot].all()  # then the slot starts the next rollout R on
            ring["bootstrapped"] = ring["bootstrapped"].at[slot].set(ring["bootstrapped"][slot] & ~complete)
            return dict(carry, ring=ring, oldest=carry["oldest"] + complete), rollout, complete, games, carry["count"]

        def call_x64(carry, params, version):
            with jax.enable_x64(x64):
                return call(carry, params, version)

        return call_x64

    return init, collect


def xla_games(c, ids, reward, terminated, truncated, info):
    """EpisodeStats.update in the jitted loop of --xla-actor: each game that ends (all of Atari's
    lives) goes into c["games"] as (env, raw score, length), c["count"] of them in this call."""
    over = info.get("terminated", terminated).astype(bool) | truncated
    returns = c["returns"].at[ids].add(info.get("reward", reward))
    at = jnp.where(over, c["count"] + jnp.cumsum(over) - 1, len(c["games"]["env"]))  # past the end: dropped
    values = {"env": ids, "return": returns[ids], "length": info["elapsed_step"]}
    games = {name: c["games"][name].at[at].set(x, mode="drop") for name, x in values.items()}
    return dict(c, games=games, count=c["count"] + over.sum(dtype=jnp.int32), returns=returns.at[ids].multiply(1.0 - over))


def f32(tree):
    """float64 leaves as float32 (envpool's MuJoCo observations, under --xla-actor)."""
    return jax.tree.map(lambda x: x.astype(np.float32) if x.dtype == np.float64 else x, tree)


def grown(carry, R: int):
    """The carry of an R-rollout ring, with 2R (rollout j sits in slot j % R, so slots move)."""
    carry = jax.device_get(carry)
    oldest = int(carry["oldest"])

    def grow(x):
        ring = np.zeros((2 * R, *x.shape[1:]), x.dtype)
        for j in range(oldest, oldest + R):
            ring[j % (2 * R)] = x[j % R]
        return ring

    return dict(carry, ring=jax.tree.map(grow, carry["ring"]))


def xla_actor_loop(envs, policy_step, shared, rollout_queue, key, args, num_rollouts, start_step, device=None, thread=0):
    """actor_loop's rollouts from one jitted call each (make_xla_rollout, --xla-actor): the same
    rows, columns, `valid`, bootstrap observations and version stamps, but the parameters are
    taken once per call, not per recv(). Timing: the call counts as "env"."""
    init, collect = make_xla_rollout(envs, policy_step, args)
    envs.async_reset()
    R, pushed, held, timing = XLA_RING, 0, None, shared.timing
    carry = jax.device_put(init(key, R), device)
    while pushed < num_rollouts and not shared.stop.is_set():
        latest, version = shared.latest
        if version != held:
            held, params = version, to_actor(device, latest)
        start = time.perf_counter()
        carry = xla_norm_from(shared.normalizer, carry)
        carry, rollout, complete, games, count = collect(R)(carry, params, np.int32(version))
        rollout, complete, games, count, steps = jax.device_get((rollout, complete, games, count, carry["steps"]))
        timing["env"] += (now := time.perf_counter()) - start
        xla_norm_to(shared.normalizer, carry)
        shared.sampled[thread] = int(steps.sum())
        games = list(zip(*(games[k][:count].tolist() for k in ("env", "return", "length"))))  # (jit sorts dict keys)
        shared.report_episodes(start_step + int(shared.sampled.sum()), games)
        if not complete:  # an env ran R rollouts ahead of another (one env's step took that long)
            carry, R = jax.device_put(grown(carry, R), device), 2 * R
            continue
        timing["bookkeeping"] += (start := time.perf_counter()) - now
        if not put(rollout_queue, rollout, shared.stop):
            return
        timing["queue_put"] += time.perf_counter() - start
        pushed += 1


def combined(a, b):
    """The (mean, variance, count) of two sets of samples from theirs (Chan et al.), leaf by leaf:
    numpy on the host, jax.numpy in the jitted loop."""
    (mean_a, var_a, n_a), (mean_b, var_b, n_b) = a, b
    n = n_a + n_b
    mean = jax.tree.map(lambda ma, mb: ma + (mb - ma) * n_b / n, mean_a, mean_b)
    var = jax.tree.map(lambda ma, va, mb, vb: (va * n_a + vb * n_b + (mb - ma) ** 2 * n_a * n_b / n) / n,
                       mean_a, var_a, mean_b, var_b)
    return mean, var, n


def xla_normalize(c, obs, reward, done, ids, args):
    """Normalizer.observe and .reward inside the jitted loop of --xla-actor. c["norm"] holds
    {"stats": the statistics (obs, return) as the host had them when the call began, then updated,
    "new": those of this call's samples alone}; xla_norm_to merges "new" into the host's after the
    call, so actor threads lose none of each other's. c["norm_returns"]: the envs' discounted returns."""
    if c["norm"] is None:
        return c, obs, reward
    (obs_stats, return_stats), (new_obs, new_return) = c["norm"]["stats"], c["norm"]["new"]
    if args.norm_obs:
        batch = jax.tree.map(lambda x: x.astype(jnp.float32), obs)
        batch = jax.tree.map(lambda x: x.mean(0), batch), jax.tree.map(lambda x: x.var(0), batch), len(ids)
        obs_stats, new_obs = combined(obs_stats, batch), combined(new_obs, batch)
        obs = jax.tree.map(lambda x, m, v: jnp.clip((x - m) / jnp.sqrt(v + 1e-8), -10, 10).astype(jnp.float32)
                           if jnp.issubdtype(x.dtype, jnp.floating) else x, obs, obs_stats[0], obs_stats[1])
    if args.norm_reward:
        returns = c["norm_returns"].at[ids].set(c["norm_returns"][ids] * args.gamma + reward)
        batch = returns[ids].mean(), returns[ids].var(), len(ids)
        return_stats, new_return = combined(return_stats, batch), combined(new_return, batch)
        c = dict(c, norm_returns=returns.at[ids].multiply(1.0 - done))
        reward = jnp.clip(reward / jnp.sqrt(return_stats[1] + 1e-8), -10, 10)
    return dict(c, norm={"stats": (obs_stats, return_stats), "new": (new_obs, new_return)}), obs, reward


def xla_norm_from(normalizer, carry):
    """The carry of a call, with the host's statistics and none of its own yet (see xla_normalize)."""
    if not (normalizer.norm_obs or normalizer.norm_reward):
        return carry
    with normalizer.lock:
        stats = normalizer.obs_stats, normalizer.return_stats
    return dict(carry, norm={"stats": stats, "new": jax.tree.map(np.zeros_like, stats)})


def xla_norm_to(normalizer, carry):
    """Merge a call's own statistics into the host's (which checkpoints save)."""
    if carry["norm"] is None:
        return
    new_obs, new_return = jax.device_get(carry["norm"]["new"])
    with normalizer.lock:
        if normalizer.norm_obs:
            normalizer.obs_stats = combined(normalizer.obs_stats, new_obs)
        if normalizer.norm_reward:
            normalizer.return_stats = combined(normalizer.return_stats, new_return)


# ---------------------------------------------------------------------------------------------
# Learning
# ---------------------------------------------------------------------------------------------


def make_optimizer(args: Args):
    """RMSProp as TorchBeast (PyTorch) computes it, with global-norm clipping: the update scales its
    step by `learning_rate_at`, applied after the momentum buffer as PyTorch does."""
    return optax.chain(
        optax.clip_by_global_norm(args.max_grad_norm),
        optax.scale_by_rms(decay=args.rmsprop_alpha, eps=args.rmsprop_eps, eps_in_sqrt=False),
        optax.trace(decay=args.rmsprop_momentum),  # also at 0 (a no-op), so --rmsprop-momentum may change on resume
    )


def rollout_forward(network, params, rollout, continuous: bool):
    """The network over a rollout: log-probabilities of its actions, entropies, values [T, B], and
    the value of `bootstrap_obs` [B]. With --lstm, each env's sequence runs from the state the
    actor recorded before row 0, reset where episodes start (`first`), on into `bootstrap_obs`
    (which starts an episode when row T-1 is a reset step, `valid` 0)."""
    T, B = rollout["rewards"].shape
    if network.lstm_size:
        obs = jax.tree.map(lambda x, y: jnp.concatenate([x, y[None]]), rollout["obs"], rollout["bootstrap_obs"])
        first = jnp.concatenate([rollout["first"], 1.0 - rollout["valid"][-1:]])
        pi, values, _ = network.apply(params, obs, (rollout["state"], first))
        logprobs, entropy = log_prob_entropy(pi[:-1], rollout["actions"], continuous)
        return logprobs, entropy, values[:-1], values[-1]
    def rows(x):  # [T, B, ...] -> [B x T, ...], env-major: rows stay on the learner device that holds their env
        return jnp.swapaxes(x, 0, 1).reshape(B * T, *x.shape[2:])

    pi, values, _ = network.apply(params, jax.tree.map(rows, rollout["obs"]))
    logprobs, entropy = log_prob_entropy(pi, rows(rollout["actions"]), continuous)
    _, bootstrap_value, _ = network.apply(params, rollout["bootstrap_obs"])
    return *(x.reshape(B, T).T for x in (logprobs, entropy, values)), bootstrap_value


def make_update(network, optimizer, args: Args, continuous: bool, mesh=None):
    """The jitted learner step: V-trace from the current parameters, lag masking, then one
    gradient step of the IMPALA loss (no epochs, no ratio clipping)."""

    def loss_fn(params, rollout, mask):
        logprobs, entropy, values, bootstrap_value = rollout_forward(network, params, rollout, continuous)
        rewards = time_limit_bootstrap(rollout["rewards"], values, bootstrap_value, rollout["truncated"], args.gamma)
        discounts = args.gamma * (1.0 - rollout["dones"])
        log_rhos = logprobs - rollout["logprobs"]
        vs, pg_advantages = vtrace(
            log_rhos, discounts, rewards, values, bootstrap_value, args.vtrace_rho_bar, args.vtrace_c_bar
        )
        loss, diagnostics = impala_loss(
            logprobs, pg_advantages, values, vs, entropy, mask, args.baseline_cost, args.entropy_cost
        )
        diagnostics["approx_kl"] = masked_mean(jnp.expm1(log_rhos) - log_rhos, mask)
        diagnostics["clipfrac"] = masked_mean((log_rhos > jnp.log(args.vtrace_rho_bar)).astype(jnp.float32), mask)
        return loss, diagnostics

    @jax.jit
    def update(state, rollout, key):
        # Policy-lag control (Sample Factory §3.4): drop transitions from too old a policy.
        lag = state["policy_version"] - rollout["policy_version"]
        fresh = (lag <= args.max_policy_lag).astype(jnp.float32)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, diagnostics), grads = grad_fn(state["params"], rollout, rollout["valid"] * fresh)
        learning_rate = learning_rate_at(args, state["global_step"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], jax.tree.map(lambda u: -learning_rate * u, updates))
        diagnostics["learning_rate"] = learning_rate
        diagnostics["loss"] = loss
        diagnostics["policy_lag_mean"] = masked_mean(lag, rollout["valid"])
        diagnostics["policy_lag_max"] = jnp.max(jnp.where(rollout["valid"] > 0, lag, 0))
        diagnostics["stale_fraction"] = masked_mean(1.0 - fresh, rollout["valid"])
        leaves = jax.tree.leaves(params)
        diagnostics["finite"] = jnp.isfinite(diagnostics["loss"]) & jnp.all(
            jnp.array([jnp.all(jnp.isfinite(x)) for x in leaves])
        )
        new_state = dict(state, params=params, opt_state=opt_state, policy_version=state["policy_version"] + 1)
        return new_state, diagnostics

    return update


def learner_loop(update, shared, queues, key, args, num_updates, ckpt_file, mesh):
    """Take one rollout from every actor thread's queue, update, publish parameters and version
    after each update. First, every process says whether it goes on (`agree`, in lockstep): a stop
    in any process stops all at the same update. Reports the update's scalars at the first update,
    every --log-frequency and at the last, also when a stop ends the loop early."""
    timing, state = shared.timing, shared.state
    batch_size, start_update, pending = global_envs(args) * args.num_steps, int(state["policy_version"]), None
    for update_idx in range(start_update, num_updates):
        start = time.perf_counter()
        rollouts = [get(q, shared.stop) for q in queues]
        timing["queue_get"] += time.perf_counter() - start
        stop, episodes = agree(shared.received, None in rollouts, [shared.episodes.popleft() for _ in range(len(shared.episodes))])
        if episodes:  # many processes: the games of all
            shared.reports.put((int(state["global_step"]), {"episodes": episodes}))
        if stop:
            break
        start = time.perf_counter()
        rollout = to_learner(mesh, joined(rollouts))  # the one transfer of the rollouts to the learner devices
        key, subkey = jax.random.split(key)
        new_state, diagnostics = update(state, rollout, subkey)
        diagnostics = jax.device_get(diagnostics)
        timing["update"] += time.perf_counter() - start
        if not diagnostics["finite"]:
            raise FloatingPointError(f"non-finite loss or parameters at update {update_idx}")
        state = dict(new_state, global_step=int(state["global_step"]) + batch_size)
        shared.state = state
        shared.latest = (state["params"], int(state["policy_version"]))
        shared.started.set()
        scalars = {f"losses/{k}": v for k, v in diagnostics.items() if k not in ("finite", "learning_rate")}
        for k in ["policy_lag_mean", "policy_lag_max", "stale_fraction"]:
            scalars[f"async/{k}"] = scalars.pop(f"losses/{k}")
        scalars["async/queue_size"] = sum(q.qsize() for q in queues)
        scalars["charts/learning_rate"] = diagnostics["learning_rate"]
        scalars.update({f"timing/{k}_seconds": v for k, v in timing.items()})
        pending = (state["global_step"], scalars)
        if update_idx == start_update or (update_idx + 1) % args.log_frequency == 0 or update_idx + 1 == num_updates:
            shared.reports.put(pending)
            pending = None
        if args.save_interval and (update_idx + 1) % args.save_interval == 0:
            save_checkpoint(ckpt_file, state, args, shared.normalizer)
    if pending:
        shared.reports.put(pending)


def joined(rollouts: list) -> dict:
    """The actor threads' rollouts side by side along the env axis: this process's share of a batch."""
    if len(rollouts) == 1:
        return rollouts[0]
    return jax.tree_util.tree_map_with_path(lambda path, *xs: np.concatenate(xs, env_axis(path)), *rollouts)


# ---------------------------------------------------------------------------------------------
# Devices and processes
# ---------------------------------------------------------------------------------------------


def start_processes(args: Args):
    """--distributed: join the run's other processes (jax.distributed), before anything uses a
    device. The coordinator's address, the process count and this process's id come from the
    flags, or else from the cluster (SLURM, Open MPI, ...). A process that dies stops the others:
    its heartbeats stop, and within 30 s they abort instead of waiting in a collective forever."""
    given = [f"--{name.replace('_', '-')}" for name, unset in
             [("coordinator_address", ""), ("num_processes", 0), ("process_id", -1)] if getattr(args, name) != unset]
    if not args.distributed:
        if given:
            raise UsageError(f"{given[0]} is for a run of many processes: pass --distributed too")
        return
    if args.num_processes < 0:
        raise UsageError(f"--num-processes must be >= 0 (0: detected), got {args.num_processes}")
    if args.process_id < -1 or (args.num_processes and not -1 < args.process_id < args.num_processes):
        raise UsageError(f"--process-id {args.process_id} must be in 0 to --num-processes - 1 ({args.num_processes - 1})")
    if (args.num_processes or args.process_id >= 0) and not args.coordinator_address:
        raise UsageError("--num-processes and --process-id need --coordinator-address HOST:PORT (process 0's)")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # collectives between CPU processes
    jax.config.update("jax_enable_preemption_service", False)  # it would take SIGTERM from Signals
    try:
        jax.distributed.initialize(
            args.coordinator_address or None, args.num_processes or None, None if args.process_id < 0 else args.process_id,
            heartbeat_timeout_seconds=30, shutdown_timeout_seconds=3600,  # the others wait at exit for process 0's evaluation
        )
    except ValueError as e:  # no cluster detected, and no --coordinator-address
        raise UsageError(f"--distributed: {e} Pass --coordinator-address, --num-processes and --process-id, "
                         "or launch under a cluster manager JAX detects (SLURM, Open MPI, ...)")


def prepare(args: Args, resumed: bool):
    """Resolve and check the flags and pick the devices: (args, actor devices, the learner's mesh).
    UsageError for a bad flag; with many processes, in every process if one has one, or if
    their flags differ (all but --process-id must match). A collective, once."""
    error = actor_devices = mesh = None
    try:
        args = resolve_args(args)
        use_compile_cache(args.compile_cache)
        actor_devices, mesh = make_mesh(args)
        check_run_dir(args, resumed)
    except UsageError as e:
        error = e
    if jax.process_count() > 1:
        flags = json.dumps({k: v for k, v in dataclasses.asdict(args).items() if k != "process_id"}, sort_keys=True)
        digest = int(hashlib.sha256(flags.encode()).hexdigest()[:7], 16)
        table = multihost_utils.process_allgather(np.array([error is not None, digest]))
        if error is None and table[:, 0].any():
            error = UsageError("another process stopped on a bad flag (its log names it)")
        elif error is None and len(set(table[:, 1])) > 1:
            error = UsageError("the processes were given different flags: give each the same, but --process-id")
    if error is not None:
        raise error
    return args, actor_devices, mesh


def actor_key(key, index: int):
    """The action-sampling key of actor `index`, counted over all processes; actor 0 keeps `key`."""
    return jax.random.fold_in(key, index) if index else key


def make_mesh(args: Args):
    """(actor devices, the learner's mesh). The device ids index this process's devices; the mesh
    lines up the learner devices of every process along one axis, "env", over which each update's
    batch is split (jit with NamedSharding: XLA partitions the update and all-reduces gradients)."""
    local = [d for d in jax.devices() if d.process_index == jax.process_index()]
    for flag, ids in [("--actor-device-ids", args.actor_device_ids), ("--learner-device-ids", args.learner_device_ids)]:
        if not ids or min(ids) < 0 or max(ids) >= len(local) or len(set(ids)) < len(ids):
            raise UsageError(f"{flag} {' '.join(map(str, ids))}: this process has {len(local)} {jax.default_backend()} "
                             f"devices, 0 to {len(local) - 1}; give each at most once")
    if local_envs(args) % len(args.learner_device_ids):
        raise UsageError(f"the {local_envs(args)} envs of this process do not divide over its "
                         f"{len(args.learner_device_ids)} learner devices (--learner-device-ids)")
    learners = [d for p in range(jax.process_count()) for d in
                np.array([d for d in jax.devices() if d.process_index == p])[args.learner_device_ids]]
    return [local[i] for i in args.actor_device_ids], jax.sharding.Mesh(np.array(learners), ("env",))


def env_axis(path) -> int:
    """The env axis of a rollout's leaf: 0 in bootstrap_obs and state ([B, ...]), else 1 ([T, B, ...])."""
    return 0 if path[0].key in ("bootstrap_obs", "state") else 1


def split_envs(mesh, axis: int):
    """The sharding of arrays whose axis `axis` (their envs) is split over the learner devices."""
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*[None] * axis, "env"))


def to_learner(mesh, rollout):
    """The one transfer of a rollout to the learner devices: this process's share of the global
    batch, split along the env axis over its learner devices."""
    by_axis = [split_envs(mesh, 0), split_envs(mesh, 1)]
    shardings = jax.tree_util.tree_map_with_path(lambda path, _: by_axis[env_axis(path)], rollout)
    if jax.process_count() == 1:
        return jax.device_put(rollout, shardings)  # one call for all leaves
    return jax.tree.map(jax.make_array_from_process_local_data, shardings, rollout)


def replicated(mesh, tree):
    """`tree` (the same values in every process) on every learner device."""
    return jax.device_put(jax.device_get(tree), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def to_actor(device, params):
    """The learner's parameters copied to an actor's device from a local replica (None: as they are)."""
    if device is None:
        return params
    return jax.tree.map(lambda x: jax.device_put(x.addressable_data(0), device), params)


def agree(received: list, stopped: bool, episodes: list):
    """Once per update, in lockstep (a collective): (whether every process stops now, the (env,
    return, length) of the games that every process finished). A process says 128 + n after
    signal n (`received`), 1 when it stops otherwise, 0 to go on, and all stop if one does:
    another's signal becomes this one's (the same exit code, a checkpoint), and another's error
    raises here. One process: (whether it stops, its own games)."""
    mine = 128 + received[0] if received else int(stopped)
    if jax.process_count() == 1:
        return mine > 0, episodes
    counts = multihost_utils.process_allgather(np.array([mine, len(episodes)]))
    table = np.zeros((max(1, counts[:, 1].max()), 3))
    table[: len(episodes)] = np.reshape(episodes, (-1, 3))
    tables = multihost_utils.process_allgather(table)
    code = int(counts[:, 0].max())
    if code == 1 and mine == 0:
        raise RuntimeError("another process stopped with an error; its log has the traceback")
    if code > 1 and not received:
        received.append(code - 128)
    return code > 0, [(int(e), float(r), int(n)) for t, k in zip(tables, counts[:, 1]) for e, r, n in t[:k]]


# ---------------------------------------------------------------------------------------------
# Logging and checkpoints
# ---------------------------------------------------------------------------------------------


class Logger:
    """TensorBoard events + metrics.jsonl ({"step", "wall_time", "tag", "value"} a line) + wandb."""

    def __init__(self, run_dir: Optional[str], args: Args):
        self.run_dir = run_dir  # None: a process other than 0, which logs nothing
        if run_dir is None:
            return
        self.writer = SummaryWriter(run_dir)
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)
        self.wandb = None
        if args.track:
            import wandb

            self.wandb = wandb.init(project=args.wandb_project, config=vars(args), dir=run_dir, resume="allow")

    def log(self, step: int, scalars: dict):
        if self.run_dir is None:
            return
        now = time.time()
        for tag, value in scalars.items():
            value = float(value)
            self.writer.add_scalar(tag, value, step, walltime=now)
            self.jsonl.write(json.dumps({"step": int(step), "wall_time": now, "tag": tag, "value": value}) + "\n")
        if self.wandb is not None:
            self.wandb.log(dict(scalars, global_step=step))

    def close(self):
        if self.run_dir is None:
            return
        self.writer.close()
        self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()


class Progress:
    """The terminal line, every `interval` s from a thread of its own, so that it never waits for a
    compile or an update: env steps sampled and learned, SPS (sampled) over the last 30 s, the
    mean game score of the last 20 episodes, and the time left at the learner's pace over the
    same 30 s (n/a until the first update)."""

    def __init__(self, total: int, counts, interval: float = 5.0):
        self.total, self.counts, self.interval = total, counts, interval  # counts() -> (sampled, learned)
        self.returns = deque(maxlen=20)  # appended by the main thread
        self.window = deque([(time.time(), *counts())], maxlen=7)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, name="progress", daemon=True)
        self.thread.start()

    def line(self) -> str:
        sampled, learned = self.counts()
        self.window.append((time.time(), sampled, learned))
        (then, sampled_then, learned_then), now = self.window[0], self.window[-1][0]
        sps = (sampled - sampled_then) / max(now - then, 1e-9)
        pace = (learned - learned_then) / max(now - then, 1e-9)
        left = (self.total - learned) / pace if pace > 0 else None
        eta = f"{int(left // 3600)}:{int(left % 3600 // 60):02d}:{int(left % 60):02d}" if left is not None else "n/a"
        returns = list(self.returns)
        mean_ret = f"{np.mean(returns):.1f}" if returns else "n/a"
        return (f"step {sampled:>10d} sampled {learned:>10d} learned of {self.total}  SPS {sps:7.0f}  "
                f"return(last 20) {mean_ret}  ETA {eta}")

    def run(self):
        while not self.done.wait(self.interval):
            print(self.line(), flush=True)

    def close(self):
        self.done.set()
        self.thread.join()


class Signals:
    """Ctrl-C and SIGTERM. The handler records the signal and sets `stop`: the run stops cleanly,
    writes a checkpoint and exits 128 + signal. Before `started` (the first update) there is
    nothing to save, and the main thread may be inside an XLA compile that Python cannot
    interrupt: a thread woken through `signal.set_wakeup_fd` then exits at once, no traceback,
    removing the folder of a new run (`new_run_dir`), which holds nothing to resume from."""

    def __init__(self):
        self.received, self.stop, self.started, self.new_run_dir = [], threading.Event(), threading.Event(), None
        self.handlers = {s: signal.signal(s, self.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        self.read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self.previous_fd = signal.set_wakeup_fd(write_fd)
        self.watcher = threading.Thread(target=self.watch, name="signals", daemon=True)
        self.watcher.start()

    def on_signal(self, signum, frame):
        self.received.append(signum)
        self.stop.set()

    def watch(self):
        while data := os.read(self.read_fd, 1):  # one byte per signal; b"" once `close` runs
            if not self.started.is_set():
                if self.new_run_dir:
                    shutil.rmtree(self.new_run_dir, ignore_errors=True)
                print(f"stopped by signal {data[0]} during start-up: nothing to save", file=sys.stderr, flush=True)
                os._exit(128 + data[0])

    def close(self):
        os.close(signal.set_wakeup_fd(self.previous_fd))
        self.watcher.join()
        os.close(self.read_fd)
        for signum, handler in self.handlers.items():
            signal.signal(signum, handler)


def save_checkpoint(path: str, state: dict, args: Args, normalizer: Normalizer):
    """Atomic write (temporary file, fsync, rename): a crash mid-write keeps the old checkpoint.
    Process 0 alone writes; the others' calls do nothing."""
    if jax.process_index():
        return
    payload = {
        "state": flax.serialization.to_state_dict(jax.device_get(dict(state, **normalizer.state()))),
        "config": json.dumps(dataclasses.asdict(args)),
        "script": os.path.basename(__file__),
        "script_path": os.path.abspath(__file__),
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


def read_checkpoint(path: str) -> dict:
    """A checkpoint of this script: {"state", "config" (a dict), "script"}; UsageError if it is
    missing, unreadable or another script's."""
    if not os.path.isfile(path):
        raise UsageError(f"--resume: no checkpoint at {path}; pass a run folder or its checkpoint.msgpack")
    try:
        with open(path, "rb") as f:
            payload = flax.serialization.msgpack_restore(f.read())
        payload["config"] = json.loads(payload["config"])
        script, payload["config"]["env_id"] = payload["script"], str(payload["config"]["env_id"])
    except Exception as e:
        raise UsageError(f"--resume: {path} is not a readable checkpoint ({type(e).__name__}); it may be corrupt")
    if script != os.path.basename(__file__):
        raise UsageError(f"--resume: {path} was written by {script}, not {os.path.basename(__file__)}")
    return payload


def load_checkpoint(payload: dict, template: dict, path: str) -> dict:
    """The checkpoint's state in the structure of `template`; UsageError if it does not fit."""
    try:
        state = flax.serialization.from_state_dict(template, payload["state"])
        shapes_match = jax.tree.map(lambda a, b: np.shape(a) == np.shape(b), template, state)
    except Exception as e:
        raise UsageError(
            f"--resume: {path} does not match this network/optimiser ({e}); it needs the run's flags and the "
            "version of the script that wrote it"
        )
    if not all(jax.tree.leaves(shapes_match)):
        raise UsageError(f"--resume: {path} has parameters of other shapes; use the flags of the run that wrote it")
    return state


# What the network and its inputs were trained on: a resumed run cannot change these.
# This launch's (the machine's devices, the processes): never restored from the run on --resume.
LAUNCH = ("distributed", "coordinator_address", "num_processes", "process_id", "actor_device_ids", "learner_device_ids")
FIXED_ON_RESUME = ("env_id", "norm_obs", "norm_reward", "lstm", "lstm_size")


def resume_args(args: Args, given):
    """With --resume: (the run's flags, those named in `given` replacing them; its checkpoint; the
    flags changed). `given`: the flags named on the command line (None: those that differ from
    Args' defaults). UsageError for a flag that cannot change mid-run. Without: (args, None, {})."""
    if not args.resume:
        return args, None, {}
    path = checkpoint_path(args.resume)
    payload, defaults = read_checkpoint(path), Args()
    fields = [f.name for f in dataclasses.fields(Args) if f.name not in ("resume", "run_dir", *LAUNCH)]
    if given is None:
        given = {name for name in fields if getattr(args, name) != getattr(defaults, name)}
    given = {name for name in given if getattr(args, name) is not None}  # None (the preset): the run's own
    stored = {name: payload["config"].get(name, getattr(defaults, name)) for name in fields}
    changed = {name: getattr(args, name) for name in fields if name in given and getattr(args, name) != stored[name]}
    for name in FIXED_ON_RESUME:
        if name in changed:
            raise UsageError(
                f"--resume: --{name.replace('_', '-')} cannot change mid-run ({path} has {stored[name]!r}); "
                "start a new run to change it"
            )
    return dataclasses.replace(args, **{name: stored[name] for name in fields if name not in given}), payload, changed


def write_config(run_dir: str, args: Args, changed: dict, global_step: int, batch: str):
    """config.json: the run's flags as first resolved, with the update's global `batch` in words,
    never overwritten; each resume appends the flags it changed, and the step it resumed from,
    under "resumes"."""
    path = os.path.join(run_dir, "config.json")
    config = dict(dataclasses.asdict(args), global_batch=batch)
    if args.resume and os.path.isfile(path):
        try:
            with open(path) as f:
                config = json.load(f)
        except ValueError:  # unreadable: start its record afresh from the resumed flags
            pass
    if args.resume:
        resume = {"step": global_step, "wall_time": time.time(), "from": os.path.abspath(args.resume), "changed": changed,
                  "global_batch": batch}
        config["resumes"] = [*config.get("resumes", []), resume]
    with open(f"{path}.tmp", "w") as f:
        json.dump(config, f, indent=2)
    os.replace(f"{path}.tmp", path)


def check_run_dir(args: Args, resumed: bool):
    """UsageError if --run-dir names a file, or a folder that holds another run (overwritten otherwise).
    Process 0's to check: it alone writes the folder."""
    if jax.process_index():
        return
    own = resumed and os.path.abspath(args.run_dir or "") == os.path.dirname(os.path.abspath(checkpoint_path(args.resume)))
    if not args.run_dir or own:
        return
    if os.path.exists(args.run_dir) and not os.path.isdir(args.run_dir):
        raise UsageError(f"--run-dir {args.run_dir} is a file, not a folder")
    if os.path.exists(os.path.join(args.run_dir, "checkpoint.msgpack")):
        raise UsageError(
            f"--run-dir {args.run_dir} already holds a run; continue it with --resume {args.run_dir}, or pick another folder"
        )
    if os.path.exists(os.path.join(args.run_dir, "config.json")):
        raise UsageError(f"--run-dir {args.run_dir} holds a run that saved no checkpoint; remove it or pick another folder")


def make_run_dir(args: Args, resumed: bool):
    """Create the run folder: --run-dir, else a resumed run's own, else a new
    runs/{env_id}__{exp_name}__{seed}__{time} (with _2, _3, ... if runs start in the same second).
    Returns (folder, whether this call created it)."""
    if args.run_dir or resumed:
        run_dir = args.run_dir or os.path.dirname(os.path.abspath(checkpoint_path(args.resume)))
        existed = os.path.isdir(run_dir)
        try:
            os.makedirs(run_dir, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--run-dir {run_dir}: cannot create it ({e.strerror})")
        return run_dir, not existed
    base = os.path.join("runs", f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}")
    for n in itertools.count(1):
        try:
            os.makedirs(base if n == 1 else f"{base}_{n}")
            return (base if n == 1 else f"{base}_{n}"), True
        except FileExistsError:
            continue


def checkpoint_file(run_dir: Optional[str]) -> str:
    """The run's checkpoint (named in messages); `run_dir` None: another process's, which says so."""
    return os.path.join(run_dir, "checkpoint.msgpack") if run_dir else "process 0's"


def open_run_dir(args: Args, resumed: bool, changed: dict, global_step: int, signals) -> Optional[str]:
    """The run folder, made or resumed, with its config.json; None in the processes other than 0."""
    if jax.process_index():
        return None
    run_dir, created = make_run_dir(args, resumed)
    signals.new_run_dir = run_dir if created and not resumed else None  # removed if stopped before an update
    write_config(run_dir, args, changed, global_step, describe_batch(args))
    return run_dir


def build(args: Args, key):
    """(network, optimizer, continuous, normalizer, initial state) of a run with these flags; a
    checkpoint restores into `dict(state, **normalizer.state())` (utils/evaluate.py does too)."""
    obs_space, action_space = spaces(args.env_id)
    continuous = not hasattr(action_space, "n")
    action_dim = int(np.prod(action_space.shape)) if continuous else int(action_space.n)
    network = ActorCritic(action_dim, continuous, encoders(obs_space), args.lstm_size if args.lstm else 0)
    params = network.init(key, zeros_like_space(obs_space, 1), zero_core(network.lstm_size, 1))
    optimizer = make_optimizer(args)
    normalizer = Normalizer(zeros_like_space(obs_space), local_envs(args), args.norm_obs, args.norm_reward, args.gamma)
    state = {"params": params, "opt_state": optimizer.init(params), "global_step": 0, "policy_version": 0}
    return network, optimizer, continuous, normalizer, state


def evaluate(
    params, network, args: Args, continuous: bool, normalizer: Normalizer, num_episodes: int, video_dir=None,
    greedy=False, signals=(),
):
    """Play `num_episodes` full games (no life loss ends, unclipped rewards); return the scores.

    Each env plays at most its share of the episodes, so that short games are not favoured.
    With `video_dir`, the first episode of the first env is written to an mp4 there. Stops early,
    with the scores so far and no video, once `signals` (the main thread's received signals) fills.
    """
    num_envs = min(num_episodes, 8)
    quota = np.full(num_envs, -(-num_episodes // num_envs))
    render = video_dir is not None and env_kind(args.env_id) not in ("mujoco", "dm_control")
    envs = make_env(
        args.env_id, num_envs, args.seed + 10_000, 1, train=False, **({"render_mode": "rgb_array"} if render else {})
    )

    @jax.jit
    def act(params, obs, core, key):
        pi, _, state = network.apply(params, obs, core)
        if greedy:
            return (jnp.split(pi, 2, axis=-1)[0] if continuous else jnp.argmax(pi, -1)), state, key
        key, subkey = jax.random.split(key)
        return sample_action(pi, subkey, continuous), state, key

    key = jax.random.PRNGKey(args.seed + 10_000)
    stats = EpisodeStats(num_envs)
    obs, info = envs.reset()
    core, done, lives = zero_core(network.lstm_size, num_envs), np.zeros(num_envs, bool), info.get("lives")
    scores, frames = [], []
    while len(scores) < num_episodes and not signals:
        if render and quota[0] == -(-num_episodes // num_envs):
            frames.append(envs.render()[0])
        action, state, key = act(params, normalizer.observe(obs, train=False), core, key)
        core = None if core is None else (state, done)  # --lstm: after an episode's end, one starts
        obs, reward, terminated, truncated, info = envs.step(env_action(np.asarray(action), envs.action_space))
        done = terminated | truncated
        if lives is not None:  # Atari: as in training (episodic life), each life lost resets the LSTM
            done, lives = done | (info["lives"] < lives), info["lives"]
        reward = np.where(info["elapsed_step"] > 0, reward, 0.0)  # a reset's reward is undefined (dm_control: NaN at times)
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


def finish(state, network, args: Args, continuous, normalizer, run_dir, logger, progress, received) -> int:
    """After training (checkpoint written): the closing lines, the final evaluation, the exit code."""
    ckpt_file = checkpoint_file(run_dir)
    if received:
        print(f"stopped by signal {received[0]} at step {int(state['global_step'])}; checkpoint: {ckpt_file}", file=sys.stderr)
        logger.close()
        return 128 + received[0]
    if progress.returns:
        print(f"final: mean return over the last {len(progress.returns)} episodes {np.mean(progress.returns):.2f}")
    if args.eval_episodes and run_dir:  # process 0's
        video_dir = os.path.join(run_dir, "videos") if args.capture_video else None
        print(f"eval: playing {args.eval_episodes} episodes with the final policy", flush=True)
        scores = evaluate(
            state["params"], network, args, continuous, normalizer, args.eval_episodes, video_dir, signals=received
        )
        if received:
            print(
                f"evaluation stopped by signal {received[0]} after {len(scores)} episodes; checkpoint: {ckpt_file}",
                file=sys.stderr,
            )
            logger.close()
            return 128 + received[0]
        logger.log(int(state["global_step"]), {"eval/episodic_return": np.mean(scores)})
        print(f"eval: {len(scores)} episodes, return {np.mean(scores):.2f} +- {np.std(scores):.2f}")
    logger.close()
    return 0


def report_errors(errors, ckpt_file: str, global_step: int) -> bool:
    """Print the threads' errors (traceback, or one line for a non-finite loss); True if the
    learner stopped on a non-finite loss, so that the last good checkpoint must stay."""
    for name, error, trace in errors:
        if isinstance(error, FloatingPointError):
            print(
                f"error: {error} (step {global_step}); "
                f"{'the last good checkpoint is kept: ' + ckpt_file if os.path.exists(ckpt_file) else 'no checkpoint written'}. "
                "Try a lower --learning-rate or --max-grad-norm.",
                file=sys.stderr,
            )
            return True
        print(f"error in the {name} thread:\n{trace}", file=sys.stderr)
    if errors:
        print(f"stopped by an error at step {global_step}; checkpoint: {ckpt_file}", file=sys.stderr)
    return False


def use_compile_cache(path: str):
    """JAX's persistent compilation cache in `path` ('': off), set before anything compiles (JAX
    reads it once per process). UsageError if the folder cannot be created or written."""
    if not path:
        return
    path = os.path.expanduser(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--compile-cache {path}: cannot create it ({e.strerror}); pass another folder, or '' for none")
    if not os.access(path, os.W_OK):
        raise UsageError(f"--compile-cache {path} is not writable; pass another folder, or '' for none")
    jax.config.update("jax_compilation_cache_dir", path)


def main(args: Args, given=None) -> int:
    """Train; return the exit code. `given`: the flags named on the command line, which replace a
    resumed run's own (None: those that differ from Args' defaults)."""
    warnings.filterwarnings("ignore", message=".*precision lowered.*")  # gymnasium's Box casts
    signals = Signals()
    try:
        return train(args, given, signals)
    finally:
        signals.close()


def train(args: Args, given, signals: Signals) -> int:
    args, payload, changed = resume_args(args, given)
    start_processes(args)
    args, actor_devices, mesh = prepare(args, payload is not None)
    batch_size = global_envs(args) * args.num_steps
    global_step = int(payload["state"]["global_step"]) if payload else 0
    if payload and global_step + batch_size > args.total_timesteps:
        print(f"{args.resume}: finished, {global_step} of --total-timesteps {args.total_timesteps} steps trained; "
              "pass a larger --total-timesteps to train on")
        return 0
    print(f"jax {jax.__version__} on {jax.default_backend()}: {', '.join(map(str, jax.local_devices()))}", flush=True)
    seed = (args.seed + global_step) % 2**31  # a resumed run draws new env seeds and noise, not the first part's
    key, init_key, update_key = jax.random.split(jax.random.PRNGKey(seed), 3)
    network, optimizer, continuous, normalizer, state = build(args, init_key)
    if payload:
        state = load_checkpoint(payload, dict(state, **normalizer.state()), checkpoint_path(args.resume))
        normalizer.load(state)
    state = dict(replicated(mesh, state), global_step=global_step)  # as every update returns it: no recompile
    run_dir = open_run_dir(args, payload is not None, changed, global_step, signals)
    ckpt_file = checkpoint_file(run_dir)
    start_update = int(state["policy_version"])
    num_updates = start_update + (args.total_timesteps - global_step) // batch_size  # the version at the end

    actors = [(device, thread) for device in actor_devices for thread in range(args.num_actor_threads)]
    first_env = jax.process_index() * len(actors) * args.num_envs  # each actor thread's envs draw their own seeds
    env_threads = args.num_threads or min(max(1, (os.cpu_count() or 1) // len(actors)), args.num_envs)  # the cores shared
    envs = [make_env(args.env_id, args.num_envs, seed + first_env + i * args.num_envs, env_threads, train=True,
                     batch_size=args.num_envs // args.num_splits) for i in range(len(actors))]
    policy_step = make_policy_step(network, continuous, values=False)  # the actor needs no values
    update = make_update(network, optimizer, args, continuous, mesh)
    logger = Logger(run_dir, args)
    shared = Shared(state, normalizer, signals.stop, signals.started, signals.received, len(actors))
    print(f"{os.path.basename(__file__)}: {args.env_id} (preset {preset_name(args.env_id)}, "
          f"{args.num_splits} split{'s' * (args.num_splits > 1)}{', XLA actor' * args.xla_actor}), "
          f"{num_updates - start_update} updates of {describe_batch(args)} -> {run_dir or 'the run folder of process 0'}", flush=True)
    start_step = global_step
    progress = Progress(args.total_timesteps,  # sampled: as if every process sampled at this one's pace
                        lambda: (start_step + int(shared.sampled.sum()) * jax.process_count(), int(shared.state["global_step"])))
    start_time = time.time()

    def log_report(step, scalars):
        for _, ret, length in scalars.pop("episodes", []):  # the actor's: the games a rollout finished
            progress.returns.append(ret)
            logger.log(step, {"charts/episodic_return": ret, "charts/episodic_length": length})
        if scalars:  # the learner's
            scalars["charts/SPS"] = (step - start_step) / (time.time() - start_time)
            scalars["async/learner_busy_fraction"] = scalars["timing/update_seconds"] / (time.time() - start_time)
            logger.log(step, scalars)

    queues = [queue.Queue(maxsize=args.queue_size) for _ in actors]
    threads = [
        start_thread(f"actor {i}" if i else "actor", xla_actor_loop if args.xla_actor else actor_loop, shared, envs[i],
                     policy_step, shared, queues[i], actor_key(key, jax.process_index() * len(actors) + i), args,
                     num_updates - start_update, global_step, device, i)
        for i, (device, _) in enumerate(actors)
    ]
    threads.append(start_thread("learner", learner_loop, shared, update, shared, queues, update_key, args, num_updates,
                                ckpt_file, mesh))
    try:
        # Until the learner has finished and its last report is logged (with SPS), or a stop.
        while (threads[-1].is_alive() or not shared.reports.empty()) and not shared.stop.is_set():
            try:
                log_report(*shared.reports.get(timeout=0.2))
            except queue.Empty:
                continue
    finally:
        shared.stop.set()
        progress.close()
        join_threads(threads, envs)
    while not shared.reports.empty():
        log_report(*shared.reports.get())
    state = shared.state
    if not report_errors(shared.errors, ckpt_file, int(state["global_step"])):
        save_checkpoint(ckpt_file, state, args, normalizer)  # not after a non-finite loss: the last good one stays
    if shared.errors:
        logger.close()
        return 1
    print(progress.line(), flush=True)
    state = dict(state, params=to_actor(actor_devices[0], state["params"]))  # evaluated on an actor device
    return finish(state, network, args, continuous, normalizer, run_dir, logger, progress, signals.received)


def flags_given(argv) -> set:
    """The Args fields named on a command line (`--flag value`, `--flag=value`, `--no-flag`)."""
    fields = {f.name for f in dataclasses.fields(Args)}
    names = {token[2:].split("=")[0].replace("-", "_") for token in argv if token.startswith("--")}
    return {name for name in names if name in fields} | {name[3:] for name in names if name.startswith("no_") and name[3:] in fields}


if __name__ == "__main__":
    try:
        exit_code = main(tyro.cli(Args, description=describe_presets()), flags_given(sys.argv[1:]))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        exit_code = 2
    if any(t.name.startswith(("actor", "learner")) and t.is_alive() for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)  # a thread still inside an XLA call would abort interpreter shutdown
    sys.exit(exit_code)
