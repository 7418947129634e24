"""Synchronous PPO on envpool, in JAX: the baseline of Sample Factory's comparison.

Collect a rollout of `num_steps` steps from `num_envs` environments with the current policy,
then update on it (epochs x minibatches of PPO-clip with GAE), then collect again: sampling and
learning take turns, which is what `appo_envpool.py` changes (`diff` the two files).

References: Schulman et al. 2017 (PPO); Schulman et al. 2016 (GAE); Huang et al. 2022,
"The 37 implementation details of PPO" (CleanRL), whose names and Atari defaults are used here;
Petrenko et al. 2020, Sample Factory §4 (this is their synchronous PPO baseline).

The run itself (flags, folders, checkpoints, logs, devices) is the installed package
`jax_async_rl`: this file holds the algorithm. Usage: python ppo_sync_baseline.py --env-id Pong-v5
"""

import dataclasses
import functools
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

from jax_async_rl import convolution, devices, flags, journal, runs, selfplay, tasks
from jax_async_rl.keys import env_keys
from jax_async_rl.flags import NON_NEGATIVE, POSITIVE, PRESET, UNIT, UsageError, at_most
from jax_async_rl.normalize import Normalizer
from jax_async_rl.trajectories import write


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
    """Synchronous PPO (collect, then update). Every size is in agent steps unless it says frames.

    Flags shown with "(default: preset)" take the value of the task's preset (listed below; the
    PRESETS table in this file); an explicit flag wins, and config.json records the values used.
    """

    # Where left at None, the task's preset fills these: the PRESETS table right above Args (an
    # explicit flag wins).
    num_steps: Annotated[Optional[int], PRESET, POSITIVE, at_most(65_536)] = None
    """rollout length: steps per environment between two updates"""
    learning_rate: Annotated[Optional[float], PRESET, POSITIVE] = None
    """Adam learning rate, the start of the schedule when --anneal-lr"""
    gamma: Annotated[Optional[float], PRESET, UNIT] = None
    """discount factor"""
    gae_lambda: Annotated[Optional[float], PRESET, UNIT] = None
    """lambda of generalised advantage estimation"""
    num_minibatches: Annotated[Optional[int], PRESET, POSITIVE] = None
    """minibatches per epoch; must divide the global batch, the envs of all processes x num_steps
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
    """number of parallel environments of this process; an update's global batch is processes x
    num_envs x num_steps env steps (config.json records it)"""
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
    """envpool worker threads stepping the environments (your Gymnasium env's: worker processes; 0:
    one per CPU core, at most num_envs)"""
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
    args = runs.checked(dataclasses.replace(args, **fill))
    if len(args.actor_device_ids) != 1:
        raise UsageError("--actor-device-ids: the synchronous loop acts on one device; give one id")
    if devices.global_envs(args) * args.num_steps % args.num_minibatches:
        raise UsageError(
            f"--num-minibatches {args.num_minibatches} must divide the global batch "
            f"{devices.describe_batch(args)}"
        )
    if args.lstm and devices.global_envs(args) % args.num_minibatches:
        raise UsageError(
            f"--num-minibatches {args.num_minibatches} must divide the "
            f"{devices.global_envs(args)} envs of an "
            "update (--num-envs of every process) with --lstm (a minibatch holds whole env "
            "sequences); pass a divisor"
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


def collect_rollout(
    envs,
    policy_step,
    params,
    obs,
    prev_dones,
    core,
    key,
    first_step,
    stats,
    normalizer,
    args,
    action_space,
    timing,
):
    """Step all envs `num_steps` times with `params`, from step `first_step` of each (its randomness
    keyed by env and step); return the rollout, next obs, dones and core.

    The rollout is time-major [T, B, ...] host arrays plus `bootstrap_obs` [B, ...]. envpool
    resets an env on the step after its episode ends, ignoring that step's action: such steps
    get `valid` 0 and stay out of the loss. `truncated` marks time-limit ends, which bootstrap.
    With --lstm, `core` (ActorCritic's) carries the envs' recurrent state from step to step and
    rollout to rollout, reset where an episode starts (`first`: the observation after an
    episode's end); the rollout records the state before row 0 ("state"), which the learner
    unrolls from, and "first".
    """
    T, B = args.num_steps, args.num_envs
    rollout = {
        "obs": jax.tree.map(lambda x: np.zeros((T, *x.shape), x.dtype), obs),
        "actions": np.zeros((T, B, *action_space.shape), action_space.dtype),
        "logprobs": np.zeros((T, B), np.float32),
        "values": np.zeros((T, B), np.float32),
        "rewards": np.zeros((T, B), np.float32),
        "dones": np.zeros((T, B), np.float32),
        "truncated": np.zeros((T, B), np.float32),
        "valid": np.zeros((T, B), np.float32),
    }
    if core is not None:
        rollout["state"], rollout["first"] = core[0], np.zeros((T, B), np.float32)
    env_ids = np.arange(B)
    for t in range(T):
        start = time.perf_counter()
        action, logprob, value, state = policy_step(
            params, obs, core, key, env_ids, np.full(B, first_step + t)
        )
        action, logprob, value = jax.device_get((action, logprob, value))
        timing["inference"] += time.perf_counter() - start
        write(rollout["obs"], t, obs)
        rollout["actions"][t] = action
        rollout["logprobs"][t], rollout["values"][t] = logprob, value
        # a reset step's action is ignored; --self-play: only the learner's own moves count
        rollout["valid"][t] = (1.0 - prev_dones) * selfplay.turns(envs, env_ids)
        if core is not None:
            rollout["first"][t] = core[1]
        start = time.perf_counter()
        obs, reward, terminated, truncated, info = envs.step(
            tasks.env_action(action, envs.action_space)
        )
        # a reset's: undefined (dm_control)
        reward = np.where(info["elapsed_step"] > 0, reward, 0.0)
        timing["env"] += time.perf_counter() - start
        stats.update(env_ids, reward, terminated, truncated, info)
        # masks obeyable
        tasks.check_legal(args, obs, env_ids, ~(terminated | truncated), info["elapsed_step"])
        prev_dones = terminated | truncated
        # after a reset step, an episode starts
        core = None if core is None else (state, rollout["valid"][t] == 0)
        obs, reward = normalizer.observe(obs), normalizer.reward(reward, prev_dones, env_ids)
        rollout["rewards"][t], rollout["dones"][t], rollout["truncated"][t] = (
            reward,
            prev_dones,
            truncated,
        )
    rollout["bootstrap_obs"] = obs
    if args.self_play:  # a row per decision of the learner's (see selfplay.decisions)
        rollout.update(selfplay.decisions(rollout))
    return rollout, obs, prev_dones, core


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


def targets(network, state, rollout, args: Args, continuous: bool):
    """What the loss learns from a rollout [T, B]: (advantages, returns, the mask of transitions
    that count, diagnostics): GAE on the values the rollout recorded."""
    values = rollout["values"]
    # With --lstm the bootstrap value needs the state after the last step: an unroll. Feed-forward,
    # XLA drops the unused pass over the rollout and computes V(bootstrap_obs) alone.
    _, _, _, bootstrap_value = rollout_forward(network, state["params"], rollout, continuous)
    rewards = time_limit_bootstrap(
        rollout["rewards"], values, bootstrap_value, rollout["truncated"], args.gamma
    )
    discounts = args.gamma * (1.0 - rollout["dones"])
    advantages = compute_gae(rewards, values, bootstrap_value, discounts, args.gae_lambda)
    return advantages, advantages + values, rollout["valid"], {}


def make_update(network, optimizer, args: Args, continuous: bool, mesh=None):
    """The jitted learner step: the targets (GAE), then epochs x minibatches of PPO-clip."""

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
        advantages, returns, valid, diagnostics = targets(network, state, rollout, args, continuous)
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


def train_loop(run, envs, action_space, policy_step, update, normalizer, key, device, resume=None):
    """Collect a rollout with the current parameters (copied to the actor `device`), update on it,
    repeat: from run.start_update to run.num_updates, or until the run stops. Once per update,
    every process agrees to go on (runs.Run.should_stop), in lockstep, and logs the games of all.
    `resume` (--deterministic): the journal's actions and the state that put the envs and the
    recurrent core back where the run stopped (journal.replay)."""
    args, state = run.args, run.state
    stats, timing = tasks.EpisodeStats(args.num_envs), {"env": 0.0, "inference": 0.0, "update": 0.0}
    # --lstm: every env starts from zeros
    core = zero_core(args.lstm_size if args.lstm else 0, args.num_envs)
    if resume is None:
        obs, dones = normalizer.observe(envs.reset()[0]), np.zeros(args.num_envs, bool)
    else:
        dones, obs = journal.replay(
            envs, resume["actions"], normalizer, stats, 0, receive_last=True
        )
        core = (
            jax.tree.unflatten(jax.tree.structure(core), resume["memory"])
            if "memory" in resume
            else core
        )
    for rollout_index in range(run.start_update, run.num_updates):
        if run.should_stop(False, stats.pop()):
            break
        params = devices.to_actor(device, state["params"])
        # --self-play: the parameters its latest and past opponents play with
        selfplay.acting(envs, int(state["policy_version"]), params)
        rollout, obs, dones, core = collect_rollout(
            envs,
            policy_step,
            params,
            obs,
            dones,
            core,
            key,
            rollout_index * args.num_steps,
            stats,
            normalizer,
            args,
            action_space,
            timing,
        )
        run.sampled[0] += args.num_envs * args.num_steps
        start = time.perf_counter()
        run.journaled(rollout["actions"], [core], {})
        state, diagnostics = update(
            state, devices.to_learner(run.mesh, rollout), run.update_key, args.total_timesteps
        )
        diagnostics = jax.device_get(diagnostics)
        timing["update"] += time.perf_counter() - start
        # --self-play: the win rates of the training games, by opponent
        state = run.learned(state, diagnostics, timing, run.win_rates.add(selfplay.outcomes(envs)))
    run.should_stop(False, stats.pop())  # the last rollout's games


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
        # --self-play: the pool of past parameters, and the policy that the opponents play
        policy = make_policy_step(network, continuous, values=False)
        pool, opponents = selfplay.setup(args, policy, state["params"], run.key)
        state = run.open(state, normalizer, pool)
        action_space = tasks.policy_space(args.env_id)  # what the policy samples
        # --deterministic: a resume replays the run's actions
        (resume,) = run.journal_for(action_space)
        # (device, env seed, action key): the synchronous loop acts on one device
        ((device, seed, key),) = run.actors()
        envs = tasks.make_env(
            args.env_id, args.num_envs, seed, run.env_threads, train=True, **opponents()
        )
        policy_step = make_policy_step(network, continuous)
        update = make_update(network, optimizer, args, continuous, run.mesh)
        # the evaluation plays the sampling policy (final, and --eval-interval's)
        player = policy, functools.partial(zero_core, network.lstm_size)
        run.begin(f"preset {tasks.preset_name(args.env_id, PRESETS)}", player)
        try:
            run.threads.run(
                "training loop",
                train_loop,
                run,
                envs,
                action_space,
                policy_step,
                update,
                normalizer,
                key,
                device,
                resume,
            )
        finally:
            envs.close()
        return run.finish()


if __name__ == "__main__":
    flags.command_line(main, Args, PRESETS)
