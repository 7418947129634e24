"""Asynchronous PPO (APPO) on envpool, in JAX: the system of Sample Factory in one file.

Sampling and learning overlap (Petrenko et al. 2020, Sample Factory):
- double-buffered sampling (§3.2): one envpool of `num_splits` x `split_size` envs; while the
  jitted policy acts on the split that `recv()` returned, envpool's C++ threads step the others;
- an actor thread runs inference with the newest published parameters (§3.4) and stamps every
  transition with the policy version that chose it;
- a learner thread takes rollouts from a bounded queue and runs PPO-clip on V-trace targets
  (Espeholt et al. 2018), masking out transitions older than `max_policy_lag` versions (§3.4).

`diff ppo_sync_baseline.py appo_envpool.py` shows exactly what makes training asynchronous.

The run itself (flags, folders, checkpoints, logs, devices) is the installed package
`jax_async_rl`: this file holds the algorithm. Usage: python appo_envpool.py --env-id Pong-v5
"""

import dataclasses
import functools
import queue
import signal
import time
from dataclasses import dataclass
from typing import Annotated, ClassVar, Optional, Tuple

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

from jax_async_rl import convolution, devices, flags, journal, runs, selfplay, tasks, threads
from jax_async_rl.keys import env_keys
from jax_async_rl.flags import NON_NEGATIVE, POSITIVE, PRESET, UNIT, UsageError, at_most
from jax_async_rl.normalize import Normalizer
from jax_async_rl.trajectories import Trajectories, write

SPLITS = flags.default_is("2 with image observations, else 1")


# Defaults of the flags left at None (marked PRESET, the first of Args below): a task's own preset
# (by name, without its version), else its family's (tasks.env_kind); an explicit flag always wins.
# rl-baselines3-zoo's batch sizes become minibatch counts at 8 envs; its gSDE exploration
# (Pendulum) is not reproduced.
NO_NORM = dict(norm_obs=False, norm_reward=False)
# Any other vector task: CleanRL's ppo.py defaults, a general starting point, not a tuned one.
CLASSIC = dict(
    num_steps=128,
    learning_rate=2.5e-4,
    gamma=0.99,
    gae_lambda=0.95,
    num_minibatches=4,
    update_epochs=4,
    clip_coef=0.2,
    ent_coef=0.01,
    **NO_NORM,
)
# envpool's pgx board games and poker (--self-play): classic's at 4x its learning rate and 10x
# its entropy bonus. A smaller bonus let self-play settle where the first mover always wins:
# the policies then lost more games to random and to their earlier selves
# (docs/algorithms/ppo.md#self-play).
PGX = dict(CLASSIC, learning_rate=1e-3, ent_coef=0.1, opponent_snapshot_interval=10)
PRESETS = {
    # CleanRL's ppo_atari_envpool.py (Huang et al. 2022): its ppo.py's values at clip 0.1.
    "atari": dict(CLASSIC, clip_coef=0.1),
    # CleanRL's ppo_continuous_action.py (2048 steps a rollout, minibatches of 64 at 8 envs), with
    # its observation and reward normalisation.
    "mujoco": dict(
        num_steps=256,
        learning_rate=3e-4,
        gamma=0.99,
        gae_lambda=0.95,
        num_minibatches=32,
        update_epochs=10,
        clip_coef=0.2,
        ent_coef=0.0,
        norm_obs=True,
        norm_reward=True,
    ),
    "pgx": PGX,
    # TicTacToe: pgx's, with 3x its entropy bonus and snapshots 5x further apart (a pool reaching
    # 400 updates back). At pgx's values, self-play settled on some seeds where the first mover
    # always wins, and the policy then lost up to 5.6% of its games to random moving second. At
    # these, sync and APPO lost 0.0% on both seats, seeds 1-3 (docs/algorithms/ppo.md#self-play).
    "TicTacToe": dict(PGX, ent_coef=0.3, opponent_snapshot_interval=50),
    "classic": CLASSIC,
    # rl-baselines3-zoo's tuned PPO (hyperparams/ppo.yml): CartPole solves within 100k steps.
    "CartPole": dict(
        num_steps=32,
        learning_rate=1e-3,
        gamma=0.98,
        gae_lambda=0.8,
        num_minibatches=1,
        update_epochs=20,
        clip_coef=0.2,
        anneal_clip=True,
        ent_coef=0.0,
        **NO_NORM,
    ),
    "Acrobot": dict(
        num_steps=256,
        learning_rate=3e-4,
        gamma=0.99,
        gae_lambda=0.94,
        num_minibatches=32,
        update_epochs=4,
        clip_coef=0.2,
        ent_coef=0.0,
        norm_obs=True,
        norm_reward=True,
    ),
    "MountainCar": dict(
        num_steps=16,
        learning_rate=3e-4,
        gamma=0.99,
        gae_lambda=0.98,
        num_minibatches=2,
        update_epochs=4,
        clip_coef=0.2,
        ent_coef=0.0,
        norm_obs=True,
        norm_reward=True,
    ),
    "Pendulum": dict(
        num_steps=1024,
        learning_rate=1e-3,
        gamma=0.9,
        gae_lambda=0.95,
        num_minibatches=128,
        update_epochs=10,
        clip_coef=0.2,
        ent_coef=0.0,
        **NO_NORM,
    ),
    "LunarLander": dict(
        num_steps=1024,
        learning_rate=3e-4,
        gamma=0.999,
        gae_lambda=0.98,
        num_minibatches=128,
        update_epochs=4,
        clip_coef=0.2,
        ent_coef=0.01,
        **NO_NORM,
    ),
    # rl-baselines3-zoo's CarRacing (512 steps, minibatches of 128 at 8 envs, reward normalisation).
    "CarRacing": dict(
        num_steps=512,
        learning_rate=1e-4,
        gamma=0.99,
        gae_lambda=0.95,
        num_minibatches=32,
        update_epochs=10,
        clip_coef=0.2,
        ent_coef=0.0,
        norm_obs=False,
        norm_reward=True,
    ),
    # The Control Suite: CleanRL's ppo_continuous_action.py, which CleanRL also benchmarks on
    # dm_control.
    "dm_control": dict(
        num_steps=256,
        learning_rate=3e-4,
        gamma=0.99,
        gae_lambda=0.95,
        num_minibatches=32,
        update_epochs=10,
        clip_coef=0.2,
        ent_coef=0.0,
        norm_obs=True,
        norm_reward=True,
    ),
    # MiniGrid and BabyAI: rl-starter-files' PPO (torch-ac): 128 steps an env, minibatches of 256,
    # lr 1e-3.
    "minigrid": dict(
        num_steps=128,
        learning_rate=1e-3,
        gamma=0.99,
        gae_lambda=0.95,
        num_minibatches=4,
        update_epochs=4,
        clip_coef=0.2,
        ent_coef=0.01,
        **NO_NORM,
    ),
    # MiniGrid's memory task: Pleines et al. 2022's recurrent PPO on MiniGrid-Memory (their
    # configs/minigrid.yaml: 256 steps an env, 8 minibatches, 4 epochs, lr 2e-4, entropy 0.001).
    "MiniGrid-MemoryS7": dict(
        num_steps=256,
        learning_rate=2e-4,
        gamma=0.99,
        gae_lambda=0.95,
        num_minibatches=8,
        update_epochs=4,
        clip_coef=0.2,
        ent_coef=0.001,
        **NO_NORM,
    ),
    # highway-env's scripts/sb3_highway_ppo.py: gamma 0.8, 10 epochs of minibatches of 64, lr 5e-4.
    "highway": dict(
        num_steps=128,
        learning_rate=5e-4,
        gamma=0.8,
        gae_lambda=0.95,
        num_minibatches=16,
        update_epochs=10,
        clip_coef=0.2,
        ent_coef=0.0,
        **NO_NORM,
    ),
    # Google Research Football's PPO reproduction (Kurach et al. 2020, 11_vs_11_easy_stochastic).
    "gfootball": dict(
        num_steps=512,
        learning_rate=3.43e-4,
        gamma=0.993,
        gae_lambda=0.95,
        num_minibatches=8,
        update_epochs=2,
        clip_coef=0.08,
        ent_coef=0.003,
        **NO_NORM,
    ),
}


@dataclass
class Args(flags.RunArgs):
    """Asynchronous PPO (actor and learner threads). Every size is in agent steps unless it says
    frames.

    Flags shown with "(default: preset)" take the value of the task's preset (listed below; the
    PRESETS table in this file); an explicit flag wins, and config.json records the values used.
    """

    # Where left at None, the task's preset fills these: the PRESETS table right above Args (an
    # explicit flag wins).
    num_steps: Annotated[Optional[int], PRESET, POSITIVE, at_most(65_536)] = None
    """rollout length: steps per environment in each rollout"""
    learning_rate: Annotated[Optional[float], PRESET, POSITIVE] = None
    """Adam learning rate, the start of the schedule when --anneal-lr"""
    gamma: Annotated[Optional[float], PRESET, UNIT] = None
    """discount factor"""
    gae_lambda: Annotated[Optional[float], PRESET, UNIT] = None
    """lambda of generalised advantage estimation, and of V-trace's traces (rlax's lambda_)"""
    num_minibatches: Annotated[Optional[int], PRESET, POSITIVE] = None
    """minibatches per epoch; must divide the global batch, the envs of all actors x num_steps
    (with an LSTM: the envs, as minibatches hold whole env sequences, and a preset's count then
    becomes its greatest common divisor with them)"""
    update_epochs: Annotated[Optional[int], PRESET, POSITIVE, at_most(1000)] = None
    """passes over each rollout"""
    clip_coef: Annotated[Optional[float], PRESET, POSITIVE] = None
    """PPO ratio clipping epsilon"""
    anneal_clip: Annotated[Optional[bool], PRESET] = None
    """decay the clip epsilon linearly to 0 over the run, as the learning rate (rl-baselines3-zoo's
    `clip_range: lin_0.2`); off where the preset does not name it"""
    ent_coef: Annotated[Optional[float], PRESET, NON_NEGATIVE] = None
    """weight of the entropy bonus"""
    norm_obs: Annotated[Optional[bool], PRESET] = None
    """True: normalise observations by a running mean and std, clipped to [-10, 10] (CleanRL,
    MuJoCo)"""
    norm_reward: Annotated[Optional[bool], PRESET] = None
    """True: divide rewards by the running std of the discounted return, clipped to [-10, 10]"""
    opponent_snapshot_interval: Annotated[Optional[int], PRESET, POSITIVE] = None
    """--self-play: updates between two snapshots of the parameters into the opponent pool (the pgx
    preset's: 10; TicTacToe's: 50)"""

    # Not in the presets: each flag below takes the default it states.
    num_envs: Annotated[int, POSITIVE, at_most(65_536)] = 8
    """number of parallel environments of each actor thread (see --num-actor-threads)"""
    num_splits: Annotated[Optional[int], SPLITS, POSITIVE] = None
    """envpool splits for double-buffered sampling (Sample Factory §3.2); 1 disables it. It pays
    where stepping a split costs about one inference call and a core is free for it: images, not
    vectors"""
    queue_size: Annotated[int, POSITIVE, at_most(1024)] = 2
    """rollouts the actor may queue ahead of the learner before it blocks (backpressure)"""
    actor_lag: Annotated[Optional[int], NON_NEGATIVE, at_most(64)] = 1
    """the actor acts on rollout m with the update on rollout m - 1 - this (acting_version): 1,
    Cleanba's actor, the learner learns from data one update old; 0, the synchronous limit; None,
    Sample Factory's free-running actor, up to --queue-size + 1 old. --deterministic: exactly that
    update, else at least it"""
    max_policy_lag: Annotated[int, NON_NEGATIVE] = 25
    """transitions chosen by a policy more than this many updates old are masked out of the loss"""
    vtrace: bool = True
    """V-trace targets (Espeholt et al. 2018), advantages without its rho (PPO's ratio weights);
    GAE when off"""
    vtrace_rho_bar: Annotated[float, POSITIVE] = 1.0
    """V-trace clipping threshold of the importance ratio in the targets (rho bar)"""
    vtrace_c_bar: Annotated[float, POSITIVE] = 1.0
    """V-trace clipping threshold of the trace-cutting coefficients (c bar)"""
    anneal_lr: bool = True
    """decay the learning rate linearly to 0 over the run"""
    norm_adv: bool = True
    """normalise advantages within each minibatch"""
    vf_coef: Annotated[float, NON_NEGATIVE] = 0.5
    """weight of the value loss"""
    max_grad_norm: Annotated[float, POSITIVE] = 0.5
    """global gradient-norm clipping threshold"""
    action_mask: bool = True
    """illegal actions get no probability, in acting and learning, where the observation holds an
    "action_mask" (Jumanji's tasks, your env's Dict); --no-action-mask: it is only an input"""
    lstm: bool = False
    """an LSTM core between the encoder and the policy/value heads (TorchBeast's --use_lstm, Sample
    Factory's --use_rnn), its state carried per env and reset where an episode starts"""
    lstm_size: Annotated[int, POSITIVE, at_most(8192)] = 128
    """hidden units of the LSTM, the size of its h and of its c (CleanRL's ppo_atari_lstm.py:
    128)"""
    num_threads: Annotated[int, NON_NEGATIVE, at_most(1024)] = 0
    """envpool worker threads of each actor thread (your Gymnasium env's: worker processes; 0: the
    CPU cores shared among the actor threads, at most num_envs)"""
    num_actor_threads: Annotated[int, POSITIVE, at_most(256)] = 1
    """actor threads on each actor device, each with num_envs envs and splits of its own; an update
    takes one rollout from each, so its global batch is processes x actor devices x actor threads x
    num_envs x num_steps env steps (config.json records it)"""
    self_play: bool = False
    """train on a turn-based game of several players (board games, poker, mahjong: envpool's
    TicTacToe-v1, ConnectFour-v1, ...) from one seat, alternating, with opponents in the others"""
    opponent_mix: Tuple[float, float, float] = (0.4, 0.2, 0.4)
    """--self-play: the fractions of games whose opponents are the latest parameters, a past
    snapshot and a uniform random legal player (they sum to 1; the default was measured against
    others on ConnectFour-v1 and TicTacToe-v1: docs/algorithms/ppo.md#self-play)"""
    opponent_pool_size: Annotated[int, POSITIVE, at_most(1024)] = 8
    """--self-play: the newest snapshots that a past opponent is drawn from"""
    # The variants these flags make: the default --exp-name (the run's folder, its header line)
    # names them.
    NAMED: ClassVar[dict] = {"lstm": dict(lstm=True), "selfplay": dict(self_play=True)}


def resolve_args(args: Args) -> Args:
    """The flags left at None filled from the task's preset, and all checked: UsageError, one
    line, before anything starts (runs.checked holds the checks every script's flags take)."""
    fill = tasks.preset_values(args, PRESETS)
    if args.anneal_clip is None:  # the presets that do not name it: off
        fill.setdefault("anneal_clip", False)
    # whole env sequences: a preset's count that divides num_envs
    if args.lstm and "num_minibatches" in fill:
        fill["num_minibatches"] = int(np.gcd(fill["num_minibatches"], devices.global_envs(args)))
    if args.num_splits is None:  # double buffering for the Nature CNN's images (see --num-splits)
        fill["num_splits"] = (
            2 if "nature" in dict(tasks.encoders(tasks.spaces(args.env_id)[0])) else 1
        )
    args = runs.checked(dataclasses.replace(args, **fill))
    if args.num_envs % args.num_splits:
        raise UsageError(
            f"--num-splits {args.num_splits} must divide --num-envs {args.num_envs} "
            "(left out, --num-splits is 2 with image observations, else 1)"
        )
    if devices.global_envs(args) * args.num_steps % args.num_minibatches:
        raise UsageError(
            f"--num-minibatches {args.num_minibatches} must divide the global batch "
            f"{devices.describe_batch(args)}"
        )
    if args.lstm and devices.global_envs(args) % args.num_minibatches:
        raise UsageError(
            f"--num-minibatches {args.num_minibatches} must divide the "
            f"{devices.global_envs(args)} envs of an "
            "update (--num-envs, summed over actors and processes) with --lstm (a minibatch holds "
            "whole env sequences); pass a divisor"
        )
    return args


# ---------------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------------


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
    return (
        np.zeros((num_envs, lstm_size), np.float32),
        np.zeros((num_envs, lstm_size), np.float32),
    ), np.ones(num_envs, bool)


class ActorCritic(nn.Module):
    """One encoder per observation leaf (`tasks.leaf_encoder`), concatenated into the trunk: with
    a Nature CNN leaf, a shared 512 ReLU layer (CleanRL's Atari network); otherwise separate 64-64
    tanh MLPs for the policy and the value (CleanRL's vector network). A Box image or vector alone
    gives exactly those networks. With `lstm_size`, an LSTM (LSTMCore) sits between the encoders
    (and the 512 layer) and the heads.

    Feed-forward: obs [B, ...] -> `pi` [B, A] (logits, or mean and log-std concatenated [B, 2A]
    for Box actions), `value` [B], None. LSTM: `core` = (state, first) and obs [T, B, ...] with
    first [T, B] (T steps of each env from `state`; first [B] is one step, obs [B, ...]) ->
    pi [T, B, A], value [T, B] (or [B, A], [B]) and the state after the last step.
    """

    action_dim: int
    continuous: bool
    encoders: tuple  # tasks.leaf_encoder of each observation leaf
    lstm_size: int = 0  # 0: no LSTM
    # a factored policy's choices in each of D dimensions: A = D x the most (legal_actions)
    heads: tuple = ()
    action_mask: bool = False  # the observation's "action_mask" is applied (legal_actions)

    @nn.compact
    def __call__(self, obs, core=None):
        orth = nn.initializers.orthogonal
        if self.lstm_size:
            state, first = core
            shape = first.shape  # [T, B], or [B] for one step
            first = first.reshape(-1, shape[-1])
            # Rows env-major [B x T, ...]: with the envs split over learner devices, each keeps its
            # own.
            obs = jax.tree.map(
                lambda x: jnp.swapaxes(
                    x.reshape(*first.shape, *x.shape[len(shape) :]), 0, 1
                ).reshape(-1, *x.shape[len(shape) :]),
                obs,
            )

        def conv(x, size, kernel, stride=1):
            return nn.relu(
                nn.Conv(
                    size,
                    (kernel, kernel),
                    (stride, stride),
                    "VALID",
                    kernel_init=orth(np.sqrt(2)),
                    conv_general_dilated=convolution.conv_general_dilated,
                )(x)
            )

        features = []
        for x, (kind, arg) in zip(jax.tree.leaves(obs), self.encoders, strict=True):
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
        x = jnp.concatenate(features, axis=-1)
        nature = any(kind == "nature" for kind, _ in self.encoders)
        if nature:
            x = nn.relu(nn.Dense(512, kernel_init=orth(np.sqrt(2)))(x))
        if self.lstm_size:
            state, x = LSTMCore(self.lstm_size)(
                state, (jnp.swapaxes(x.reshape(*first.shape[::-1], -1), 0, 1), first)
            )
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
            pi, value = (
                jnp.swapaxes(y.reshape(*first.shape[::-1], *y.shape[1:]), 0, 1) for y in (pi, value)
            )
            return pi.reshape(*shape, -1), value.reshape(shape), state
        return pi, value, None


# ---------------------------------------------------------------------------------------------
# Math (pure functions; tests import them)
# ---------------------------------------------------------------------------------------------


def sample_action(pi, keys, continuous: bool, greedy: bool = False, legal=None):
    """Sample actions [B] (discrete; [B, D] factored) or [B, A] (Gaussian, unclipped) from `pi`,
    row i with key keys[i] (its env's at its step: keys.env_keys, so an env's draws do not depend
    on the batch), only `legal` ones (masked_logits); `greedy`: the most likely ones (the mean)."""
    if continuous:
        mean, log_std = jnp.split(pi, 2, axis=-1)
        noise = jax.vmap(lambda key, m: jax.random.normal(key, m.shape))(keys, mean)
        return mean if greedy else mean + jnp.exp(log_std) * noise
    pi = masked_logits(pi, legal)
    return jnp.argmax(pi, -1) if greedy else jax.vmap(jax.random.categorical)(keys, pi)


def log_prob_entropy(pi, actions, continuous: bool, legal=None):
    """Log-probability of `actions` under `pi` and the policy's entropy, both [B], with only `legal`
    actions (masked_logits); a factored policy's (actions [B, D]) are the sums over its
    dimensions."""
    if continuous:
        mean, log_std = jnp.split(pi, 2, axis=-1)
        z = (actions - mean) / jnp.exp(log_std)
        logprob = jnp.sum(-0.5 * z**2 - log_std - 0.5 * jnp.log(2 * jnp.pi), axis=-1)
        entropy = jnp.sum(log_std + 0.5 * (1.0 + jnp.log(2 * jnp.pi)), axis=-1)
        return logprob, entropy
    log_p = jax.nn.log_softmax(masked_logits(pi, legal))
    logprob = jnp.take_along_axis(log_p, actions[..., None].astype(jnp.int32), axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
    if log_p.ndim > pi.ndim:  # independent dimensions: log-probabilities and entropies add
        return logprob.sum(-1), entropy.sum(-1)
    return logprob, entropy


def masked_logits(pi, legal):
    """The logits `pi` [..., A] with every action that `legal` (nonzero: legal) forbids at the
    lowest float: it gets no probability, and log-probabilities stay finite (Huang & Ontanon 2022).
    `legal` [..., A]: one categorical; [..., D, K] with D x K = A: D of them, the logits returned
    [..., D, K]; None: `pi` as it is."""
    if legal is None:
        return pi
    return jnp.where(legal > 0, pi.reshape(legal.shape), jnp.finfo(pi.dtype).min)


def legal_actions(network, obs, pi):
    """What masked_logits takes for the logits `pi` [..., A] of observations `obs`: their
    "action_mask" (with `network.action_mask`) as [..., A], a joint one flattened; with
    `network.heads` (a factored policy: D dimensions of at most K choices) [..., D, K], where a
    dimension's values past its own choices are illegal too; None: all legal."""
    if not network.heads:
        return obs["action_mask"].reshape(pi.shape) if network.action_mask else None
    choices = np.arange(max(network.heads)) < np.array(network.heads)[:, None]  # [D, K]
    legal = obs["action_mask"].reshape(*pi.shape[:-1], *choices.shape) if network.action_mask else 1
    return jnp.broadcast_to(legal * choices, (*pi.shape[:-1], *choices.shape))


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

    _, advantages = jax.lax.scan(
        backward, jnp.zeros_like(bootstrap_value), (deltas, discounts), reverse=True
    )
    return advantages


def vtrace(
    log_rhos,
    discounts,
    rewards,
    values,
    bootstrap_value,
    clip_rho_threshold=1.0,
    clip_c_threshold=1.0,
    clip_pg_rho_threshold=1.0,
    lambda_=1.0,
):
    """V-trace targets and policy-gradient advantages (Espeholt et al. 2018, eq. 1 and §4.2),
    with rlax's `lambda_` (vtrace_td_error_and_advantage): traces c = lambda min(c bar, rho), and
    the advantage bootstraps on lambda vs + (1 - lambda) V, so that on-policy the targets are
    TD(lambda)'s and the advantages GAE(lambda)'s (lambda 1: the paper's).

    log_rhos = log pi(a|x) - log mu(a|x), discounts, rewards, values: [T, B]; bootstrap_value: [B].
    clip_pg_rho_threshold None: no rho in the advantage (for a loss whose ratio pi / mu already
    weights each sample, as PPO's does). Returns (vs, pg_advantages), both [T, B], gradients
    stopped.
    """
    rhos = jnp.exp(log_rhos)
    clipped_rhos = jnp.minimum(clip_rho_threshold, rhos)
    cs = lambda_ * jnp.minimum(clip_c_threshold, rhos)
    next_values = jnp.concatenate([values[1:], bootstrap_value[None]], axis=0)
    deltas = clipped_rhos * (rewards + discounts * next_values - values)

    def backward(carry, x):
        delta, discount, c = x
        carry = delta + discount * c * carry
        return carry, carry

    _, vs_minus_v = jax.lax.scan(
        backward, jnp.zeros_like(bootstrap_value), (deltas, discounts, cs), reverse=True
    )
    vs = vs_minus_v + values
    next_vs = jnp.concatenate([vs[1:], bootstrap_value[None]], axis=0)
    next_vs = lambda_ * next_vs + (1.0 - lambda_) * next_values
    pg_advantages = rewards + discounts * next_vs - values
    if clip_pg_rho_threshold is not None:
        pg_advantages = jnp.minimum(clip_pg_rho_threshold, rhos) * pg_advantages
    return jax.lax.stop_gradient(vs), jax.lax.stop_gradient(pg_advantages)


def time_limit_bootstrap(rewards, values, bootstrap_value, truncated, gamma):
    """Fold gamma * V(final obs) into the reward of steps cut by a time limit (Pardo et al. 2018).

    envpool shows the final observation of an episode on the following (reset) step, so its
    value is the next entry of `values` (or `bootstrap_value` after the last step). With this
    reward, `discounts = gamma * (1 - done)` may cut every episode end. Shapes as compute_gae.
    """
    next_values = jnp.concatenate([values[1:], bootstrap_value[None]], axis=0)
    return rewards + gamma * truncated * next_values


def learning_rate_at(args: Args, global_step, total_timesteps):
    """Learning rate of the update that starts at env step `global_step`: with --anneal-lr it falls
    linearly to 0 at --total-timesteps (CleanRL). A function of steps, not of an optimiser count,
    so a resumed run continues its schedule, also with another budget or batch size; the budget
    is an argument of the jitted update, so that a larger one compiles nothing new."""
    return (
        linear_decay(args.learning_rate, global_step, total_timesteps)
        if args.anneal_lr
        else args.learning_rate
    )


def linear_decay(value, global_step, total_timesteps):
    """`value` scaled by the fraction of the budget left at env step `global_step` (0 past it)."""
    return value * jnp.clip(1.0 - global_step * (1.0 / total_timesteps), 0.0, 1.0)


def clip_coef_at(args: Args, global_step, total_timesteps):
    """PPO's clip epsilon in the update that starts at env step `global_step`: with --anneal-clip
    it falls linearly to 0 at --total-timesteps, as the learning rate does (a resumed run goes
    on)."""
    return (
        linear_decay(args.clip_coef, global_step, total_timesteps)
        if args.anneal_clip
        else args.clip_coef
    )


def masked_mean(x, mask):
    """Mean of `x` over the entries where `mask` is 1."""
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def ppo_loss(
    logprobs,
    old_logprobs,
    advantages,
    values,
    returns,
    entropy,
    mask,
    clip_coef,
    vf_coef,
    ent_coef,
    norm_adv,
):
    """PPO-clip surrogate (Schulman et al. 2017, eq. 7) + value regression - entropy bonus, on
    advantages normalised over the minibatch when `norm_adv` (CleanRL's detail 7).

    All inputs have one shape ([N], or [T, N] with --lstm); transitions with mask 0 do not count.
    Returns (loss, diagnostics).
    """
    if norm_adv:
        mean = masked_mean(advantages, mask)
        advantages = (advantages - mean) / (
            jnp.sqrt(masked_mean((advantages - mean) ** 2, mask)) + 1e-8
        )
    log_ratio = logprobs - old_logprobs
    ratio = jnp.exp(log_ratio)
    pg_loss = masked_mean(
        jnp.maximum(
            -advantages * ratio, -advantages * jnp.clip(ratio, 1 - clip_coef, 1 + clip_coef)
        ),
        mask,
    )
    value_loss = 0.5 * masked_mean((values - returns) ** 2, mask)
    entropy_loss = masked_mean(entropy, mask)
    loss = pg_loss + vf_coef * value_loss - ent_coef * entropy_loss
    diagnostics = {
        "policy_loss": pg_loss,
        "value_loss": value_loss,
        "entropy": entropy_loss,
        "approx_kl": masked_mean((ratio - 1) - log_ratio, mask),
        "clipfrac": masked_mean((jnp.abs(ratio - 1) > clip_coef).astype(jnp.float32), mask),
        "explained_variance": jnp.where(
            jnp.sum(mask) > 0,
            1
            - masked_mean((returns - values) ** 2, mask)
            / jnp.maximum(masked_mean((returns - masked_mean(returns, mask)) ** 2, mask), 1e-8),
            0.0,
        ),
    }
    return loss, diagnostics


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------


def make_policy_step(network, continuous: bool, values: bool = True, greedy: bool = False):
    """One jitted call per environment step of envs `env_ids` [B] at their steps `steps` [B]
    (their randomness keyed by both and the run's `key`): actions, their log-probabilities,
    values (None with `values` False: XLA then skips the critic, a third of a small MLP's acting
    time) and the recurrent state after the step (`core`: see ActorCritic; None without --lstm).
    `greedy`: the most likely actions (evaluation's option)."""

    @jax.jit
    def policy_step(params, obs, core, key, env_ids, steps):
        pi, value, state = network.apply(params, obs, core)
        legal = legal_actions(network, obs, pi)
        action = sample_action(pi, env_keys(key, env_ids, steps, jnp), continuous, greedy, legal)
        logprob, _ = log_prob_entropy(pi, action, continuous, legal)
        return action, logprob, value if values else None, state

    return policy_step


def acting_version(rollout: int, actor_lag, oldest: int) -> int:
    """The policy version that acts on rollout `rollout` (the replay scripts' chunk; counted over
    the run): the one the update on rollout `rollout - 1 - actor_lag` makes (Cleanba's actor at 1; 0
    the synchronous limit), and never one before `oldest`, the first the run holds (0; on resume the
    checkpoint's, or the oldest it carried: the resumed run acts with it until the schedule passes
    it). Sample Factory's free-running actor (None) waits for the first update alone, which compiles
    meanwhile (else the queue fills with rollouts of the initial parameters)."""
    return min(rollout, 1) if actor_lag is None else max(oldest, rollout - actor_lag)


def actor_loop(
    envs,
    policy_step,
    shared,
    rollout_queue,
    key,
    args,
    action_space,
    num_rollouts,
    device=None,
    thread=0,
    first=0,
    resume=None,
):
    """Double-buffered sampling (Sample Factory §3.2): act on the split `recv()` returns while
    envpool steps the others; queue `num_rollouts` rollouts (Trajectories), each with the games that
    ended in it, blocking while the queue is full. Rollout m (from `first`) is acted with the
    parameters `acting_version` names (§3.4; exactly those with --deterministic), each env's draws
    keyed by its index and step. With --lstm, `memory` holds each env's state, reset where an
    episode starts; a rollout records the states before its row 0 (Sample Factory's: no burn-in).
    Thread `thread` acts on `device`. `action_space`: the actions the policy samples (main's
    tasks.policy_space). `resume` (--deterministic): the journal's actions [steps, B, ...] and
    states that put the envs back where the run stopped (journal.replay)."""
    T, B = args.num_steps, args.num_envs
    # (c, h) [B, lstm_size], by env id
    memory = zero_core(args.lstm_size, B)[0] if args.lstm else None
    stats, timing, pushed = tasks.EpisodeStats(B), shared.timing, 0
    normalizer = shared.normalizer
    if args.deterministic:  # several threads take turns (the order of their steps is timing's)
        normalizer = normalizer.in_turn(thread, B, T, shared.stop)
    dones, memory = journal.start_envs(envs, resume, normalizer, stats, memory, thread * B)
    trajectories = Trajectories(T, B, action_space, memory, first * T, resume is not None, dones)
    core = held = params = None  # held: the version of `params`
    while pushed < num_rollouts and not shared.stop.is_set():
        start = time.perf_counter()
        obs, reward, terminated, truncated, info = envs.recv()
        now = time.perf_counter()
        timing["env"] += now - start
        env_ids = info["env_id"]
        index = trajectories.steps[env_ids]
        # A reset's reward is undefined (dm_control).
        reward = np.where(info["elapsed_step"] > 0, reward, 0.0)
        obs = normalizer.observe(obs)
        ended = trajectories.sent[env_ids]  # the observation ends a step (not an env's first)
        if memory is not None:  # the envs' states, and which observations start an episode
            states = jax.tree.map(lambda s: s[env_ids], memory)
            core = (states, trajectories.prev_dones[env_ids] | ~ended)
        stats.update(env_ids, reward, terminated, truncated, info)  # game scores: raw rewards
        done = terminated | truncated
        tasks.check_legal(args, obs, env_ids, ~done, info["elapsed_step"])  # masks obeyable
        if ended.any() and index.max() == trajectories.start:
            stats.pop()  # the last step replayed: its games were logged
        reward[ended] = normalizer.reward(reward[ended], done[ended], env_ids[ended] + thread * B)
        trajectories.returned(env_ids, obs, reward, done, truncated, memory)
        # Then the queue, and the wait for parameters.
        timing["bookkeeping"] += time.perf_counter() - now
        while pushed < num_rollouts:
            rollout = trajectories.complete()
            if rollout is None:
                break
            # --self-play: the games' results by opponent, and a row per decision of the learner's
            rollout = rollout._replace(games=stats.pop(), outcomes=selfplay.outcomes(envs))
            if args.self_play:
                rollout = rollout._replace(**selfplay.decisions(rollout._asdict()))
            start = time.perf_counter()
            if not threads.put(rollout_queue, rollout, shared.stop):
                return
            timing["queue_put"] += time.perf_counter() - start
            pushed += 1
        version = acting_version(int(index.max()) // T, args.actor_lag, shared.oldest)
        if not args.deterministic:
            # Free-running: never an update on a rollout not queued yet (with splits, an env may
            # still be in it).
            version = min(version, first + pushed)
        acting = shared.acting(version, args.deterministic)
        if acting is None:  # the run stops
            return
        if acting[1] != held:  # copied to this actor's device once per version
            held, params = acting[1], devices.to_actor(device, acting[0])
            # --self-play: the parameters its latest and past opponents play with
            selfplay.acting(envs, held, params)
        start = time.perf_counter()
        action, logprob, _, state = policy_step(params, obs, core, key, env_ids, index)
        now = time.perf_counter()
        timing["inference"] += now - start  # dispatched; the bookkeeping overlaps it
        # --self-play: only the learner's own moves count (selfplay.turns)
        current = trajectories.started(env_ids, obs, held, core, selfplay.turns(envs, env_ids))
        start = time.perf_counter()
        timing["bookkeeping"] += start - now
        action, logprob, state = jax.device_get((action, logprob, state))
        now = time.perf_counter()
        timing["device_get"] += now - start
        if memory is not None:
            write(memory, env_ids, state)
        envs.send(tasks.env_action(action, envs.action_space), env_ids)
        trajectories.acted(current, env_ids, action, logprob)
        shared.sampled[thread] += len(env_ids)
        timing["bookkeeping"] += time.perf_counter() - now


# ---------------------------------------------------------------------------------------------
# Learning
# ---------------------------------------------------------------------------------------------


def make_optimizer(args: Args):
    """Adam with global-norm clipping; the update scales its step by `learning_rate_at`."""
    return optax.chain(optax.clip_by_global_norm(args.max_grad_norm), optax.scale_by_adam(eps=1e-5))


def rollout_forward(network, params, rollout, continuous: bool):
    """The network over a rollout: log-probabilities of its actions, entropies, values [T, B], and
    the value of `bootstrap_obs` [B]. With --lstm, each env's sequence runs from the state the
    actor recorded before row 0, reset where episodes start (`first`), on into `bootstrap_obs`
    (which starts an episode when row T-1 is a reset step, `valid` 0)."""
    T, B = rollout["rewards"].shape
    if network.lstm_size:
        obs = jax.tree.map(
            lambda x, y: jnp.concatenate([x, y[None]]), rollout["obs"], rollout["bootstrap_obs"]
        )
        first = jnp.concatenate([rollout["first"], 1.0 - rollout["valid"][-1:]])
        pi, values, _ = network.apply(params, obs, (rollout["state"], first))
        legal = legal_actions(network, rollout["obs"], pi[:-1])  # the masks stored with the rollout
        logprobs, entropy = log_prob_entropy(pi[:-1], rollout["actions"], continuous, legal)
        return logprobs, entropy, values[:-1], values[-1]

    def rows(
        x,
        # [T, B, ...] -> [B x T, ...], env-major: rows stay on the learner device that holds their
        # env
    ):
        return jnp.swapaxes(x, 0, 1).reshape(B * T, *x.shape[2:])

    obs = jax.tree.map(rows, rollout["obs"])
    pi, values, _ = network.apply(params, obs)
    logprobs, entropy = log_prob_entropy(
        pi, rows(rollout["actions"]), continuous, legal_actions(network, obs, pi)
    )
    _, bootstrap_value, _ = network.apply(params, rollout["bootstrap_obs"])
    return *(x.reshape(B, T).T for x in (logprobs, entropy, values)), bootstrap_value


def minibatches(key, data, num_minibatches: int):
    """One epoch's shuffled minibatches [M, ...] of a rollout's `data` (leaves [T, B, ...]).
    Feed-forward: transitions from all of T x B. With --lstm (`data` holds the recorded "state"
    [B, ...]): whole env sequences [M, T, B / M, ...], each with its state."""
    T, B = data["valid"].shape
    if "state" not in data:
        order = jax.random.permutation(key, T * B)
        return jax.tree.map(
            lambda x: x.reshape(T * B, *x.shape[2:])[order].reshape(
                num_minibatches, -1, *x.shape[2:]
            ),
            data,
        )
    order = jax.random.permutation(key, B)

    def split(x):  # [B, ...] -> [M, B / M, ...] in the shuffled env order
        return x[order].reshape(num_minibatches, B // num_minibatches, *x.shape[1:])

    state = jax.tree.map(split, data["state"])
    sequences = jax.tree.map(
        lambda x: jnp.swapaxes(split(jnp.swapaxes(x, 0, 1)), 1, 2), {**data, "state": None}
    )
    return dict(sequences, state=state)


def targets(network, state, rollout, args: Args, continuous: bool, clip_coef):
    """What the loss learns from a rollout [T, B]: (advantages, returns, the mask of transitions
    that count, diagnostics): V-trace (or GAE) from the current parameters, and policy-lag
    control (Sample Factory §3.4): transitions from too old a policy do not count."""
    logprobs, _, values, bootstrap_value = rollout_forward(
        network, state["params"], rollout, continuous
    )
    rewards = time_limit_bootstrap(
        rollout["rewards"], values, bootstrap_value, rollout["truncated"], args.gamma
    )
    discounts = args.gamma * (1.0 - rollout["dones"])
    log_ratio = logprobs - rollout["logprobs"]  # pi / mu before this update moves pi
    # the advantage without IMPALA's rho: PPO's ratio is already each sample's weight
    if args.vtrace:
        returns, advantages = vtrace(
            log_ratio,
            discounts,
            rewards,
            values,
            bootstrap_value,
            args.vtrace_rho_bar,
            args.vtrace_c_bar,
            clip_pg_rho_threshold=None,
            lambda_=args.gae_lambda,
        )
    else:
        advantages = compute_gae(rewards, values, bootstrap_value, discounts, args.gae_lambda)
        returns = advantages + values
    lag = state["policy_version"] - rollout["policy_version"]
    fresh = (lag <= args.max_policy_lag).astype(jnp.float32)
    ratio = jnp.exp(log_ratio)
    diagnostics = {
        "async/policy_lag_mean": masked_mean(lag, rollout["valid"]),
        "async/policy_lag_max": jnp.max(jnp.where(rollout["valid"] > 0, lag, 0)),
        "async/stale_fraction": masked_mean(1.0 - fresh, rollout["valid"]),
        "async/start_clipfrac": masked_mean(
            (jnp.abs(ratio - 1) > clip_coef).astype(jnp.float32), rollout["valid"]
        ),
        "async/start_kl": masked_mean(ratio - 1 - log_ratio, rollout["valid"]),
        "async/rho_clipfrac": masked_mean(
            (ratio > args.vtrace_rho_bar).astype(jnp.float32), rollout["valid"]
        ),
    }
    return advantages, returns, rollout["valid"] * fresh, diagnostics


def make_update(network, optimizer, args: Args, continuous: bool, mesh=None):
    """The jitted learner step: the targets (V-trace or GAE, lag masking), then epochs x
    minibatches of PPO-clip against the behaviour policy (Sample Factory's APPO)."""

    def loss_fn(params, mb, clip_coef):
        pi, values, _ = network.apply(
            params, mb["obs"], (mb["state"], mb["first"]) if "state" in mb else None
        )
        logprobs, entropy = log_prob_entropy(
            pi, mb["actions"], continuous, legal_actions(network, mb["obs"], pi)
        )
        return ppo_loss(
            logprobs,
            mb["logprobs"],
            mb["advantages"],
            values,
            mb["returns"],
            entropy,
            mb["valid"],
            clip_coef,
            args.vf_coef,
            args.ent_coef,
            args.norm_adv,
        )

    def minibatch_step(learning_rate, clip_coef, carry, mb):
        params, opt_state = carry
        (loss, diagnostics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, mb, clip_coef
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, jax.tree.map(lambda u: -learning_rate * u, updates))
        return (params, opt_state), {
            "loss": loss,
            "grad_norm": optax.global_norm(grads),
            **diagnostics,
        }

    @jax.jit
    def update(state, rollout, key, total_timesteps):
        key = jax.random.fold_in(key, state["policy_version"])  # the update's own: a resume too
        params, opt_state = state["params"], state["opt_state"]
        steps = args.update_epochs * args.num_minibatches
        unroll = convolution.unrolled_scans(network.encoders, steps)  # native convs on a CPU
        clip_coef = clip_coef_at(args, state["global_step"], total_timesteps)
        advantages, returns, valid, diagnostics = targets(
            network, state, rollout, args, continuous, clip_coef
        )
        data = {
            "obs": rollout["obs"],
            "actions": rollout["actions"],
            "logprobs": rollout["logprobs"],
            "valid": valid,
            "advantages": advantages,
            "returns": returns,
        }
        if network.lstm_size:
            data.update(state=rollout["state"], first=rollout["first"])
        learning_rate = learning_rate_at(args, state["global_step"], total_timesteps)

        def epoch(carry, key):
            epoch_data = minibatches(key, data, args.num_minibatches)
            # each learner device takes its share of every minibatch: data parallel
            if mesh is not None:
                epoch_data = jax.tree_util.tree_map_with_path(
                    lambda path, x: jax.lax.with_sharding_constraint(
                        x,
                        devices.split_envs(
                            mesh, 1 + (devices.env_axis(path) if "state" in data else 0)
                        ),
                    ),
                    epoch_data,
                )
            return jax.lax.scan(
                functools.partial(minibatch_step, learning_rate, clip_coef),
                carry,
                epoch_data,
                unroll=unroll,
            )

        epoch_keys = jax.random.split(key, args.update_epochs)
        (params, opt_state), losses = jax.lax.scan(
            epoch, (params, opt_state), epoch_keys, unroll=unroll
        )
        diagnostics.update(jax.tree.map(jnp.mean, losses), learning_rate=learning_rate)
        if args.anneal_clip:
            diagnostics["clip_coef"] = clip_coef
        leaves = jax.tree.leaves(params)
        diagnostics["finite"] = jnp.isfinite(diagnostics["loss"]) & jnp.all(
            jnp.array([jnp.all(jnp.isfinite(x)) for x in leaves])
        )
        new_state = dict(
            state, params=params, opt_state=opt_state, policy_version=state["policy_version"] + 1
        )
        return new_state, diagnostics

    return update


def learner_loop(run, update, shared, queues, key):
    """Take one rollout from every actor thread's queue, update, publish the parameters and their
    version after each update (§3.4): from run.start_update to run.num_updates, or until the run
    stops. Once per update, before it, every process agrees to go on (runs.Run.should_stop), in
    lockstep (a stop in any process stops all at the same update), and the games of the rollouts
    learned from last are logged."""
    state, timing, games = run.state, shared.timing, []  # games: of the rollouts last learned from
    for _ in range(run.start_update, run.num_updates):
        start = time.perf_counter()
        rollouts = [threads.get(q, run.stop) for q in queues]
        timing["queue_get"] += time.perf_counter() - start
        if run.should_stop(None in rollouts, games):
            break
        games = [game for rollout in rollouts for game in rollout.games]
        start = time.perf_counter()
        batch = devices.joined([rollout.arrays() for rollout in rollouts])
        # --lstm: the states after the rollouts, for a checkpoint (journal.Keeper).
        memories = [rollout.next_state for rollout in rollouts]
        run.journaled(batch["actions"], memories, shared.published)
        batch = devices.to_learner(run.mesh, batch)
        state, diagnostics = update(state, batch, key, run.args.total_timesteps)
        diagnostics = jax.device_get(diagnostics)
        timing["update"] += time.perf_counter() - start
        pipeline = {
            "timing/queue_size": sum(q.qsize() for q in queues),
            "timing/learner_busy_fraction": timing["update"] / run.elapsed(),
        }
        # --self-play: the win rates of the training games, by opponent
        pipeline.update(run.win_rates.add([o for r in rollouts for o in r.outcomes]))
        state = run.learned(state, diagnostics, timing, pipeline)
        shared.publish(state["params"], int(state["policy_version"]))
    else:
        run.should_stop(False, games)  # the last rollouts' games


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def build(args: Args, key):
    """(network, optimizer, continuous, normalizer, initial state) of a run with these flags; a
    checkpoint restores into `dict(state, **normalizer.state())` (utils/evaluate.py does too)."""
    obs_space, action_space = (
        tasks.spaces(args.env_id)[0],
        tasks.policy_space(args.env_id),
    )  # what the policy samples
    # multi-discrete, factored: a categorical a dimension
    heads = tuple(map(int, getattr(action_space, "nvec", ())))
    continuous = not hasattr(action_space, "n") and not heads
    action_dim = (
        len(heads) * max(heads)
        if heads
        else int(getattr(action_space, "n", np.prod(action_space.shape)))
    )
    network = ActorCritic(
        action_dim,
        continuous,
        tasks.encoders(obs_space),
        args.lstm_size if args.lstm else 0,
        heads,
        args.action_mask and tasks.mask_shape(obs_space) is not None,
    )
    params = network.init(
        key, tasks.zeros_like_space(obs_space, 1), zero_core(network.lstm_size, 1)
    )
    optimizer = make_optimizer(args)
    normalizer = Normalizer(
        tasks.zeros_like_space(obs_space),
        devices.local_envs(args),
        args.norm_obs,
        args.norm_reward,
        args.gamma,
    )
    state = {
        "params": params,
        "opt_state": optimizer.init(params),
        "global_step": 0,
        "policy_version": 0,
    }
    return network, optimizer, continuous, normalizer, state


def main(args: Args, given=None) -> int:
    """Train; return the exit code. `given`: the flags named on the command line, which replace a
    resumed run's own (None: those that differ from Args' defaults)."""
    with runs.Run(args, given, __file__, resolve_args) as run:
        if run.finished:
            return 0
        args = run.args
        network, optimizer, continuous, normalizer, state = build(args, run.init_key)
        # --self-play: the pool of past parameters (kept for an actor up to queue + lag + 2
        # versions behind the learner), and the policy that the opponents play
        margin = args.queue_size + (args.actor_lag or 0) + 2
        policy = make_policy_step(network, continuous, values=False)
        pool, opponents = selfplay.setup(args, policy, state["params"], run.key, margin)
        state = run.open(state, normalizer, pool)
        action_space = tasks.policy_space(args.env_id)  # what the policy samples
        # --deterministic: a resume replays the run's actions
        resumes = run.journal_for(action_space)
        actors = run.actors()  # (device, env seed, action key) of each actor thread
        envs = [
            tasks.make_actor_env(
                args.env_id,
                args.num_envs,
                seed,
                run.env_threads,
                args.num_splits,
                args.deterministic,
                **opponents(),
            )
            for _, seed, _ in actors
        ]
        # The actor needs no values.
        policy_step = make_policy_step(network, continuous, values=False)
        update = make_update(network, optimizer, args, continuous, run.mesh)
        shared = threads.Shared(
            state["params"],
            state["policy_version"],
            normalizer,
            run.sampled,
            run.stop,
            learning=True,
            keep=(args.actor_lag or 0) + 2,
            published=run.keeper and run.keeper.acting(),
        )
        # the evaluation plays the sampling policy (final, and --eval-interval's)
        player = policy, functools.partial(zero_core, network.lstm_size)
        run.begin(
            f"preset {tasks.preset_name(args.env_id, PRESETS)}, {args.num_splits} "
            f"split{'s' * (args.num_splits > 1)}",
            player,
        )
        queues = [queue.Queue(maxsize=args.queue_size) for _ in actors]
        for i, (device, _, key) in enumerate(actors):
            run.threads.start(
                f"actor {i}" if i else "actor",
                actor_loop,
                envs[i],
                policy_step,
                shared,
                queues[i],
                key,
                args,
                action_space,
                run.num_updates - run.start_update,
                device,
                i,
                run.start_update,
                resumes[i],
                owns=envs[i],
            )
        run.wait(
            run.threads.start("learner", learner_loop, run, update, shared, queues, run.update_key)
        )
        return run.finish()


if __name__ == "__main__":
    flags.command_line(main, Args, PRESETS)
