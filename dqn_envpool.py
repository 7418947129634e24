"""Asynchronous DQN on envpool, in JAX: rlpyt's second family, with its variants behind flags.

DQN with a target network (Mnih et al. 2015) and what Rainbow (Hessel et al. 2018) adds but
noisy nets: Double DQN (van Hasselt et al. 2016), the dueling head (Wang et al. 2016), n-step
returns, proportional prioritised replay (Schaul et al. 2016) and the distributional C51
(Bellemare et al. 2017). Exploration is ε-greedy on CleanRL's linear schedule, or Ape-X's fixed
ε per env (Horgan et al. 2018).

Sampling and optimisation run asynchronously, as rlpyt's async mode (Stooke & Abbeel 2019):
- actor threads step envpool splits (double buffering, Sample Factory §3.2) with the newest
  parameters, and hand the learner chunks of `num_steps` steps of every env;
- the learner owns the replay buffer (jax_async_rl.replay): it adds a chunk, runs
  `replay_ratio x chunk / batch_size` gradient steps on batches sampled from it, publishes.
  One chunk per round through a bounded queue holds the replay ratio whichever side is faster.
`--serial` runs the same functions in one thread, collect then update (rlpyt's serial mode).

The run itself (flags, folders, checkpoints, logs, devices) is the installed package
`jax_async_rl`: this file holds the algorithm. Usage: python dqn_envpool.py --env-id Pong-v5
"""

import dataclasses
import functools
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
from jax_async_rl.flags import NON_NEGATIVE, POSITIVE, PRESET, UNIT, UsageError, at_most
from jax_async_rl.keys import EnvStreams
from jax_async_rl.normalize import Normalizer
from jax_async_rl.replay import Collecting, Replay, check_rounds, gradient_steps, sample_rows
from jax_async_rl.sequences import SequenceReplay

SPLITS = flags.default_is("2 with image observations, else 1")
# ε of the evaluation games (Dopamine's Rainbow: a greedy Atari agent can stall)
EVAL_EPSILON = 0.001
# evaluation_player's, in words (utils/evaluate.py says it)
EVAL_POLICY = f"ε-greedy at ε {EVAL_EPSILON}"
RESCALE_EPS = 1e-3  # ε of R2D2's value rescaling h (Kapturowski et al. 2019)
SEQUENCE_FIELDS = (
    "obs",
    "action",
    "reward",
    "terminated",
    "truncated",
)  # a sequence's rows (SequenceReplay)


# Defaults of the flags left at None (marked PRESET, the first of Args below): a task's own preset
# (by name, without its version), else its family's (tasks.env_kind); with --lstm, an R2D2 preset
# (preset_name). An explicit flag always wins.
PLAIN = dict(double_dqn=False, dueling=False, n_step=1, prioritized_replay=False, c51=False)
# Rainbow's prioritised replay (α 0.5, β 0.4 -> 1), gradients clipped at 10 (rlpyt,
# Stable-Baselines3), the ε schedule.
RAINBOW_REPLAY = dict(
    priority_alpha=0.5,
    priority_beta=0.4,
    priority_beta_end=1.0,
    max_grad_norm=10.0,
    apex_epsilon=False,
)
PRESETS = {
    # Rainbow minus noisy nets (rlpyt's "ernbw"): Hessel et al. 2018, Table 1 (Adam 6.25e-5 with
    # eps 1.5e-4, 3-step, α 0.5, β 0.4 -> 1, 51 atoms in [-10, 10], target every 32k frames, 80k
    # frames first, one update of 32 every 4 steps), with CleanRL's dqn_atari_jax.py ε schedule
    # in place of noisy nets (1 -> 0.01 over the first 10%).
    "atari": dict(
        num_steps=4,
        buffer_size=1_000_000,
        learning_starts=20_000,
        replay_ratio=8.0,
        batch_size=32,
        learning_rate=6.25e-5,
        adam_eps=1.5e-4,
        gamma=0.99,
        target_network_frequency=8000,
        start_e=1.0,
        end_e=0.01,
        exploration_fraction=0.1,
        double_dqn=True,
        dueling=True,
        n_step=3,
        prioritized_replay=True,
        c51=True,
        huber_delta=1.0,
        anneal_lr=False,
        **RAINBOW_REPLAY,
    ),
    # Any other vector task: CleanRL's dqn.py (batches of 128 every 10 steps, target every 500).
    "classic": dict(
        num_steps=5,
        buffer_size=10_000,
        learning_starts=10_000,
        replay_ratio=12.8,
        batch_size=128,
        learning_rate=2.5e-4,
        adam_eps=1e-8,
        gamma=0.99,
        target_network_frequency=500,
        start_e=1.0,
        end_e=0.05,
        exploration_fraction=0.5,
        huber_delta=0.0,
        anneal_lr=False,
        **PLAIN,
        **RAINBOW_REPLAY,
    ),
    # rl-baselines3-zoo's tuned DQN (hyperparams/dqn.yml: 128 gradient steps of 64 every 256 steps)
    # with changes measured here over 500k steps (docs/algorithms/dqn.md): its learning rate 2.3e-3
    # -> 5e-4 and a buffer of the whole run (500k; with its 100k the policy forgot its failures and
    # fell back), 3-step returns and Double DQN (as published, squared error: Q diverged to 1,834),
    # the rate annealed to 0 (constant, 2 of 6 runs ended in a dip: last 20 episodes 437.8, 472.8).
    "CartPole": dict(
        num_steps=32,
        buffer_size=500_000,
        learning_starts=1000,
        replay_ratio=32.0,
        batch_size=64,
        learning_rate=5e-4,
        adam_eps=1e-8,
        gamma=0.99,
        target_network_frequency=10,
        start_e=1.0,
        end_e=0.04,
        exploration_fraction=0.16,
        huber_delta=0.0,
        anneal_lr=True,
        **dict(PLAIN, n_step=3, double_dqn=True),
        **RAINBOW_REPLAY,
    ),
    # --lstm on Atari, R2D2 as rlpyt's atari_r2d1.py runs it (Kapturowski et al. 2019, Table 2): γ
    # 0.997, sequences of 80 after a burn-in of 40, one every 40 steps, 5-step double-Q targets,
    # squared error, priorities α 0.9 (η 0.9), β 0.6, Adam 1e-4 with eps 1e-3, gradients clipped at
    # 80, batches of 32 sequences (the paper: 64), rlpyt's replay ratio 4 (burn-in rows counted: one
    # gradient step per 960 env steps, its sampler's), target every 2,500 updates (2.4M env steps),
    # learning from 100k steps, a 1M buffer, Ape-X's ε per env, an LSTM of 512.
    "atari-lstm": dict(
        num_steps=120,
        buffer_size=1_000_000,
        learning_starts=100_000,
        replay_ratio=4.0,
        batch_size=32,
        learning_rate=1e-4,
        adam_eps=1e-3,
        gamma=0.997,
        target_network_frequency=2_400_000,
        start_e=1.0,
        end_e=0.01,
        exploration_fraction=0.1,
        double_dqn=True,
        dueling=True,
        n_step=5,
        prioritized_replay=True,
        c51=False,
        huber_delta=0.0,
        priority_alpha=0.9,
        priority_beta=0.6,
        priority_beta_end=0.6,
        max_grad_norm=80.0,
        apex_epsilon=True,
        anneal_lr=False,
        lstm_size=512,
        seq_len=80,
        burn_in=40,
        seq_period=40,
    ),
    # --lstm on any other task: a small R2D2, measured on two memory tasks (docs/algorithms/dqn.md).
    "lstm": dict(
        num_steps=20,
        buffer_size=100_000,
        learning_starts=2000,
        replay_ratio=48.0,
        batch_size=32,
        learning_rate=1e-3,
        adam_eps=1e-3,
        gamma=0.99,
        target_network_frequency=2000,
        start_e=1.0,
        end_e=0.05,
        exploration_fraction=0.2,
        double_dqn=True,
        dueling=True,
        n_step=3,
        prioritized_replay=True,
        c51=False,
        huber_delta=0.0,
        priority_alpha=0.9,
        priority_beta=0.6,
        priority_beta_end=0.6,
        max_grad_norm=80.0,
        apex_epsilon=False,
        anneal_lr=False,
        lstm_size=64,
        seq_len=20,
        burn_in=10,
        seq_period=10,
    ),
}


@dataclass
class Args(flags.RunArgs):
    """Asynchronous DQN and its Rainbow variants (actor and learner threads, or --serial). Every
    size is in agent steps unless it says frames.

    Flags shown with "(default: preset)" take the value of the task's preset (listed below; the
    PRESETS table in this file); an explicit flag wins, and config.json records the values used.
    """

    # Where left at None, the task's preset fills these: the PRESETS table right above Args (an
    # explicit flag wins).
    num_steps: Annotated[Optional[int], PRESET, POSITIVE, at_most(65_536)] = None
    """steps of every env in each chunk an actor hands the learner; the learner's round (one chunk,
    then its gradient steps) is an "update" in the logs and checkpoints"""
    buffer_size: Annotated[Optional[int], PRESET, POSITIVE] = None
    """replay buffer capacity in transitions (the oldest are overwritten)"""
    learning_starts: Annotated[Optional[int], PRESET, NON_NEGATIVE] = None
    """env steps before the first gradient step (a resumed run refills its buffer this long)"""
    replay_ratio: Annotated[Optional[float], PRESET, POSITIVE, at_most(100_000.0)] = None
    """transitions the learner samples per env step (rlpyt's replay_ratio: batch_size / train
    frequency); each round's gradient steps are this x the chunk / --batch-size, a whole number"""
    batch_size: Annotated[Optional[int], PRESET, POSITIVE] = None
    """transitions in each gradient step's batch"""
    learning_rate: Annotated[Optional[float], PRESET, POSITIVE] = None
    """Adam learning rate"""
    adam_eps: Annotated[Optional[float], PRESET, POSITIVE] = None
    """Adam's epsilon"""
    anneal_lr: Annotated[Optional[bool], PRESET] = None
    """the learning rate falls linearly to 0 at --total-timesteps (the CartPole preset)"""
    huber_delta: Annotated[Optional[float], PRESET, NON_NEGATIVE] = None
    """TD errors beyond this get a constant gradient (the Huber loss: Mnih et al. 2015's error
    clipping, for clipped rewards); 0: the squared error (CleanRL). Not used by --c51"""
    max_grad_norm: Annotated[Optional[float], PRESET, POSITIVE] = None
    """global gradient-norm clipping threshold (rlpyt's and Stable-Baselines3's DQN: 10; R2D2:
    80)"""
    gamma: Annotated[Optional[float], PRESET, UNIT] = None
    """discount factor"""
    target_network_frequency: Annotated[Optional[int], PRESET, POSITIVE] = None
    """env steps between updates of the target network (checked once a round)"""
    start_e: Annotated[Optional[float], PRESET, UNIT] = None
    """ε of ε-greedy at the start"""
    end_e: Annotated[Optional[float], PRESET, UNIT] = None
    """ε of ε-greedy at the end of the schedule"""
    exploration_fraction: Annotated[Optional[float], PRESET, UNIT] = None
    """the fraction of --total-timesteps over which ε falls linearly from --start-e to --end-e"""
    apex_epsilon: Annotated[Optional[bool], PRESET] = None
    """Ape-X's fixed ε per env instead of the schedule: env i of N has --apex-base ** (1 +
    --apex-alpha x i / (N - 1))"""
    double_dqn: Annotated[Optional[bool], PRESET] = None
    """Double DQN: the online network picks the next action, the target network values it"""
    dueling: Annotated[Optional[bool], PRESET] = None
    """the dueling head: a value and mean-centred advantages"""
    n_step: Annotated[Optional[int], PRESET, POSITIVE, at_most(1000)] = None
    """n-step returns: rewards summed over n steps (fewer at an episode's end), then bootstrapped"""
    prioritized_replay: Annotated[Optional[bool], PRESET] = None
    """proportional prioritised replay: priorities (|TD error| + eps) ^ --priority-alpha"""
    priority_alpha: Annotated[Optional[float], PRESET, UNIT] = None
    """prioritisation exponent α (Rainbow: 0.5)"""
    priority_beta: Annotated[Optional[float], PRESET, UNIT] = None
    """importance-sampling exponent β at the start, annealed linearly to --priority-beta-end over
    the run (Rainbow: 0.4)"""
    priority_beta_end: Annotated[Optional[float], PRESET, UNIT] = None
    """importance-sampling exponent β at the end of the run (Rainbow: 1; R2D2 keeps 0.6
    throughout)"""
    c51: Annotated[Optional[bool], PRESET] = None
    """distributional C51: a categorical return distribution over --num-atoms fixed atoms"""
    lstm_size: Annotated[Optional[int], PRESET, POSITIVE, at_most(8192)] = None
    """--lstm: hidden units of the LSTM, the size of its h and of its c"""
    seq_len: Annotated[Optional[int], PRESET, POSITIVE, at_most(100_000)] = None
    """--lstm: steps of each replayed sequence that the loss covers, after its burn-in"""
    burn_in: Annotated[Optional[int], PRESET, NON_NEGATIVE, at_most(100_000)] = None
    """--lstm: steps before those, over which the networks only rebuild the state from the stored
    one"""
    seq_period: Annotated[Optional[int], PRESET, POSITIVE, at_most(100_000)] = None
    """--lstm: a sequence starts every this many steps of each env, where the actor's state is
    stored (sequences overlap when it is below --burn-in + --seq-len)"""

    # Not in the presets: each flag below takes the default it states.
    num_envs: Annotated[int, POSITIVE, at_most(65_536)] = 8
    """number of parallel environments of each actor thread (see --num-actor-threads)"""
    num_splits: Annotated[Optional[int], SPLITS, POSITIVE] = None
    """envpool splits for double-buffered sampling (Sample Factory §3.2); 1 disables it"""
    queue_size: Annotated[int, POSITIVE, at_most(1024)] = 1
    """chunks an actor may queue ahead of the learner before it waits (backpressure)"""
    actor_lag: Annotated[Optional[int], NON_NEGATIVE, at_most(64)] = None
    """an actor collects chunk m with the round on chunk m - 1 - this (acting_version): 0, the
    serial mode's data; None, rlpyt's free-running actor (the newest parameters). --deterministic:
    exactly that round (1 where none is given), else at least it"""
    serial: bool = False
    """one thread: collect a chunk, then learn from the buffer, in turn (rlpyt's serial mode)"""
    tau: Annotated[float, UNIT] = 1.0
    """target network update rate (1: a copy)"""
    apex_base: Annotated[float, UNIT] = 0.4
    """Ape-X's base ε (Horgan et al. 2018)"""
    apex_alpha: Annotated[float, NON_NEGATIVE, at_most(100.0)] = 7.0
    """Ape-X's exponent spread (Horgan et al. 2018)"""
    num_atoms: Annotated[int, POSITIVE, at_most(4096)] = 51
    """atoms of C51's support"""
    v_min: float = -10.0
    """C51's smallest return"""
    v_max: float = 10.0
    """C51's largest return"""
    action_mask: bool = True
    """where the observation holds an "action_mask" (Jumanji's tasks, your env's Dict), ε-greedy
    explores, acts greedily and takes its target's maximum over legal actions; --no-action-mask: it
    is only an input"""
    lstm: bool = False
    """R2D2 (Kapturowski et al. 2019): an LSTM after the encoder, learned from replayed sequences
    that start from the state the actor stored, after a burn-in; value-rescaled n-step targets"""
    priority_eta: Annotated[float, UNIT] = 0.9
    """--lstm: a sequence's priority, η max|δ| + (1 - η) mean|δ| over its steps (R2D2: 0.9)"""
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
    NAMED: ClassVar[dict] = {"serial": dict(serial=True), "lstm": dict(lstm=True)}
    # What a run saved before a flag existed did: --resume continues it so.
    UNTIL_ADDED: ClassVar[dict] = {"huber_delta": 1.0, "anneal_lr": False}


RAINBOW = {
    k: v for k, v in PRESETS["atari"].items() if k in PLAIN
}  # the five switches, for any task
LSTM_ONLY = ("lstm_size", "seq_len", "burn_in", "seq_period")


def preset_name(args) -> str:
    """The PRESETS entry of the task (tasks.preset_name); with --lstm, R2D2's for Atari, else the
    small one."""
    name = tasks.preset_name(args.env_id, PRESETS)
    return ("atari-lstm" if name == "atari" else "lstm") if args.lstm else name


def resolve_args(args: Args) -> Args:
    """The flags left at None filled from the task's preset, and all checked: UsageError, one
    line, before anything starts (runs.checked holds the checks every script's flags take)."""
    fill = tasks.preset_values(args, PRESETS)  # the task checked first (a user's env made known)
    given = [k for k in LSTM_ONLY if getattr(args, k) is not None]
    if args.lstm:
        fill = {k: v for k, v in PRESETS[preset_name(args)].items() if getattr(args, k) is None}
    elif given:
        flag = given[0].replace("_", "-")
        raise UsageError(
            f"--{flag} {getattr(args, given[0])} is a flag of --lstm (R2D2); add --lstm, "
            "or leave it out"
        )
    if hasattr(tasks.policy_space(args.env_id), "nvec"):
        raise UsageError(
            f"--env-id {args.env_id} has multi-discrete actions without a joint mask (a factored "
            f"policy, one "
            "choice a dimension); DQN's Q-values are over one set of actions: use appo_envpool.py"
        )
    if not hasattr(tasks.policy_space(args.env_id), "n"):
        raise UsageError(
            f"--env-id {args.env_id} has continuous actions; DQN picks one of a finite set: "
            "use sac_envpool.py (or appo_envpool.py)"
        )
    if args.num_splits is None:
        fill["num_splits"] = (
            2 if "nature" in dict(tasks.encoders(tasks.spaces(args.env_id)[0])) else 1
        )
    args = runs.checked(dataclasses.replace(args, **fill))
    if args.lstm:
        check_sequences(args)
    check_rounds(args, args.n_step + 4)
    if args.c51 and not args.v_min < args.v_max:
        raise UsageError(f"--v-min {args.v_min} must be below --v-max {args.v_max}")
    if args.c51 and args.num_atoms < 2:
        raise UsageError(f"--num-atoms {args.num_atoms}: C51 needs at least 2")
    return args


def check_sequences(args: Args):
    """--lstm's flags: UsageError, one line, for C51 (not with sequences here) and for sequences
    longer than each env's ring holds (whole --seq-period blocks of it), and for legal-action masks
    (the recurrent act and r2d2_targets take every action)."""
    if args.c51:
        raise UsageError(
            "--c51 with --lstm: R2D2 here learns Q-values, not C51's distributions; pass --c51 "
            "False"
        )
    if args.action_mask and tasks.mask_shape(tasks.spaces(args.env_id)[0]) is not None:
        raise UsageError(
            f"--lstm does not apply action masks yet (--env-id {args.env_id}'s observation holds "
            f"one): "
            "pass --no-action-mask"
        )
    stack = tasks.spaces(args.env_id)[0].shape[0] if tasks.env_kind(args.env_id) == "atari" else 1
    rows = args.buffer_size // devices.local_envs(args) // args.seq_period * args.seq_period
    need = args.burn_in + args.seq_len + args.n_step + args.seq_period + stack
    if rows < need:
        raise UsageError(
            f"--buffer-size {args.buffer_size:,} keeps {rows:,} steps of each of the "
            f"{devices.local_envs(args)} "
            f"envs; sequences of --burn-in {args.burn_in} + --seq-len {args.seq_len} + --n-step "
            f"{args.n_step} "
            f"steps, one every --seq-period {args.seq_period}, need {need:,}: raise --buffer-size "
            f"or shorten them"
        )


# ---------------------------------------------------------------------------------------------
# Network
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


class QNetwork(nn.Module):
    """`encode`, then with a Nature CNN leaf a 512 ReLU layer (Mnih et al. 2015), otherwise a
    256-256 ReLU MLP (rl-baselines3-zoo's CartPole DQN). Then the Q head: obs [B, ...] -> Q-values
    [B, A], or with `num_atoms` the logits [B, A, atoms] of C51's return distribution; `dueling`:
    a value stream and an advantage stream whose mean over actions is subtracted (Wang et al.
    2016, eq. 9). With `lstm_size`, an LSTM (the PPO scripts' LSTMCore) between those layers and
    the head (R2D2): `core` = (state (c, h) [B, size], first), obs [T, B, ...] and first [T, B]
    (T steps of each env from `state`, reset where an episode starts; or one step: obs [B, ...],
    first [B]) -> (Q-values [T, B, A] (or [B, A]), the state after the last step)."""

    action_dim: int
    encoders: tuple  # tasks.leaf_encoder of each observation leaf
    dueling: bool = False
    num_atoms: int = 0  # 0: plain Q-values
    action_mask: bool = False  # the observation's "action_mask" is applied (legal_actions)
    lstm_size: int = 0  # 0: no LSTM

    @nn.compact
    def __call__(self, obs, core=None):
        # rows env-major [B x T, ...]: with the envs split over learner devices, each keeps its own
        if self.lstm_size:
            state, first = core
            shape = first.shape  # [T, B], or [B] for one step
            first = first.reshape(-1, shape[-1])
            obs = jax.tree.map(
                lambda x: jnp.swapaxes(
                    x.reshape(*first.shape, *x.shape[len(shape) :]), 0, 1
                ).reshape(-1, *x.shape[len(shape) :]),
                obs,
            )
        x = encode(obs, self.encoders)
        for size in [512] if any(kind == "nature" for kind, _ in self.encoders) else [256, 256]:
            x = nn.relu(nn.Dense(size)(x))
        if self.lstm_size:
            state, x = LSTMCore(self.lstm_size)(
                state, (jnp.swapaxes(x.reshape(*first.shape[::-1], -1), 0, 1), first)
            )
            x = jnp.swapaxes(x, 0, 1).reshape(-1, self.lstm_size)
        atoms = max(self.num_atoms, 1)
        q = nn.Dense(self.action_dim * atoms)(x).reshape(-1, self.action_dim, atoms)
        if self.dueling:
            value = nn.Dense(atoms)(x)[:, None]
            q = value + q - q.mean(axis=1, keepdims=True)
        q = q if self.num_atoms else q[..., 0]
        if self.lstm_size:  # back to time-major
            q = jnp.swapaxes(q.reshape(*first.shape[::-1], *q.shape[1:]), 0, 1)
            return q.reshape(*shape, *q.shape[2:]), state
        return q


# ---------------------------------------------------------------------------------------------
# Math (pure functions; tests import them)
# ---------------------------------------------------------------------------------------------


def linear_schedule(start: float, end: float, duration: float, t):
    """CleanRL's linear schedule: `start` at t = 0, `end` from t = duration on."""
    slope = (end - start) / max(duration, 1.0)
    return max(slope * t + start, end)


def apex_epsilons(num_envs: int, base: float, alpha: float):
    """Ape-X's per-actor ε (Horgan et al. 2018, §4): ε_i = base ^ (1 + alpha x i / (N - 1)), [N]."""
    i = np.arange(num_envs)
    return base ** (1.0 + alpha * i / max(num_envs - 1, 1))


def epsilon_at(args, step: int):
    """ε of every env of the run [global envs] at env step `step`: Ape-X's fixed ones, or the
    linear schedule's (one value for all)."""
    if args.apex_epsilon:
        return apex_epsilons(devices.global_envs(args), args.apex_base, args.apex_alpha).astype(
            np.float32
        )
    e = linear_schedule(
        args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, step
    )
    return np.full(devices.global_envs(args), e, np.float32)


def importance_exponent(args, step: int) -> float:
    """Prioritised replay's importance-sampling exponent β at env step `step`: --priority-beta
    annealed linearly to --priority-beta-end over the run (Schaul et al. 2016); 0 (no weights)
    under uniform replay."""
    if not args.prioritized_replay:
        return 0.0
    return args.priority_beta + (args.priority_beta_end - args.priority_beta) * min(
        1.0, step / args.total_timesteps
    )


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


def q_targets(next_q_target, next_q_online, reward, discount, double: bool, legal=None):
    """The (n-step) DQN target [B]: reward + discount x Q_target(s', a'), where a' is the target
    network's argmax (Mnih et al. 2015) or, `double`, the online network's (van Hasselt et al.
    2016, eq. 4), among the actions `legal` in s' ([B, A]: see legal_argmax). next_q_*: [B, A];
    reward, discount [B] (discount: gamma^k, 0 after a termination)."""
    best = legal_argmax(next_q_online if double else next_q_target, legal)
    return reward + discount * jnp.take_along_axis(next_q_target, best[:, None], axis=-1)[:, 0]


def legal_argmax(q, legal):
    """The best action [B] by `q` [B, A] among the legal ones: `legal` [B, A] nonzero (a row with
    none: action 0, whose Q-value stays finite); None: all."""
    return jnp.argmax(q if legal is None else jnp.where(legal > 0, q, -jnp.inf), axis=-1)


def legal_actions(network, obs, batch_size: int):
    """The legal actions [B, A] of a batch of observations: their "action_mask" (a joint one over
    several dimensions flattened, as tasks.policy_space) with `network.action_mask`; else None."""
    return obs["action_mask"].reshape(batch_size, -1) if network.action_mask else None


def random_legal(legal, uniform):
    """An action [B] drawn uniformly among the legal ones of each row of `legal` [B, A] (nonzero:
    legal; a row with none: action 0) by the row's uniform in [0, 1) (`uniform` [B])."""
    count = np.maximum(np.count_nonzero(legal, axis=1), 1)
    k = np.minimum((uniform * count).astype(np.int64), count - 1)  # the k-th legal action
    return np.argmax(np.cumsum(legal > 0, axis=1) > k[:, None], axis=1)


def c51_project(next_probs, reward, discount, support):
    """C51's target distribution (Bellemare et al. 2017, Algorithm 1): the atoms of `support` [K]
    moved to reward + discount x z, clipped to the support, and each atom's probability
    (`next_probs` [B, K]) split between its two nearest atoms. Returns [B, K]."""
    v_min, v_max = support[0], support[-1]
    delta = (v_max - v_min) / (support.shape[0] - 1)
    tz = jnp.clip(reward[:, None] + discount[:, None] * support[None], v_min, v_max)
    b = (tz - v_min) / delta
    lower, upper = jnp.floor(b), jnp.ceil(b)
    # An atom that lands exactly on one (lower == upper) gives it all its mass.
    to_lower = next_probs * (upper + (lower == upper) - b)
    to_upper = next_probs * (b - lower)
    index = jnp.arange(next_probs.shape[0])[:, None]
    target = jnp.zeros_like(next_probs)
    target = target.at[index, lower.astype(jnp.int32)].add(to_lower)
    return target.at[index, upper.astype(jnp.int32)].add(to_upper)


def value_rescale(x, eps: float = RESCALE_EPS):
    """R2D2's value rescaling h(x) = sign(x)(sqrt(|x| + 1) - 1) + eps x (Kapturowski et al. 2019,
    §2.3, after Pohlen et al. 2018): the network learns h(Q), whose range grows like sqrt(Q).
    sqrt(a + 1) - 1 is computed as a / (sqrt(a + 1) + 1): in float32 the difference loses most
    digits near 0."""
    return x / (jnp.sqrt(jnp.abs(x) + 1.0) + 1.0) + eps * x


def value_unrescale(z, eps: float = RESCALE_EPS):
    """h's inverse (Pohlen et al. 2018, Proposition A.2): sign(z)(((sqrt(1 + 4 eps (|z| + 1 + eps))
    - 1) / (2 eps))^2 - 1), rearranged without its two differences of near-equal numbers (as
    written it is off by 1e-4 near 0 in float32): with a = |z| and d = sqrt(1 + 4 eps (a + 1 +
    eps)), sign(z) 4a (a + 1 + eps)(2a + 3 + 2 eps + d) / ((2a + 1 + 2 eps + d)(d + 1)^2)."""
    a = jnp.abs(z)
    d = jnp.sqrt(1.0 + 4.0 * eps * (a + 1.0 + eps))
    return (
        jnp.sign(z)
        * 4.0
        * a
        * (a + 1.0 + eps)
        * (2.0 * a + 3.0 + 2.0 * eps + d)
        / ((2.0 * a + 1.0 + 2.0 * eps + d) * jnp.square(d + 1.0))
    )


def r2d2_targets(
    q_target, q_online, reward, terminated, truncated, gamma: float, n_step: int, double: bool
):
    """R2D2's targets [T - n, B] of rows 0 .. T-n-1 of sequences of T rows: h(G + gamma^k
    h^-1(Q_target(s_{t+k}, a*))), G the rewards of rows t+1 .. t+k discounted, k = n or the first
    of those rows that ends the episode: terminated, nothing bootstrapped; truncated, the value of
    its observation, the episode's real last (n_step_return's rule). a*:
    the online network's argmax with `double` (van Hasselt et al. 2016), else the target's.
    q_*: [T, B, A] (h's scale); reward, terminated, truncated [T, B], as the rows store them (those
    of the step that produced each row's observation)."""
    length = reward.shape[0] - n_step
    best = jnp.argmax(q_online if double else q_target, axis=-1)
    value = value_unrescale(jnp.take_along_axis(q_target, best[..., None], axis=-1)[..., 0])
    ret, discount, bootstrap = (
        jnp.zeros_like(reward[:length]),
        jnp.ones_like(reward[:length]),
        jnp.zeros_like(reward[:length]),
    )
    alive = jnp.ones(ret.shape, bool)
    for k in range(1, n_step + 1):
        rows = slice(k, k + length)
        ret = ret + alive * discount * reward[rows]
        bootstrap = jnp.where(alive, value[rows], bootstrap)
        discount = jnp.where(alive, jnp.where(terminated[rows], 0.0, discount * gamma), discount)
        alive = alive & ~(terminated[rows] | truncated[rows])
    return value_rescale(ret + discount * bootstrap)


def sequence_priorities(errors, mask, eta: float):
    """R2D2's priority of each sequence [B]: eta max |δ| + (1 - eta) mean |δ| over its steps that
    `mask` [T, B] keeps (errors: the TD errors δ [T, B])."""
    errors = jnp.abs(errors) * mask
    return eta * errors.max(axis=0) + (1.0 - eta) * errors.sum(axis=0) / jnp.maximum(
        mask.sum(axis=0), 1
    )


def unroll(network, params, obs, first, state, burn_in: int = 0):
    """The Q-values [T, B, A] of sequences (obs [T, B, ...], first [T, B]) from the recurrent
    `state`, reset where an episode starts; no gradient flows through the first `burn_in` rows,
    which only rebuild the state (R2D2's burn-in)."""
    if not burn_in:
        return network.apply(params, obs, (state, first))[0]
    head = jax.tree.map(lambda x: x[:burn_in], obs)
    q_head, state = jax.lax.stop_gradient(network.apply(params, head, (state, first[:burn_in])))
    q, _ = network.apply(params, jax.tree.map(lambda x: x[burn_in:], obs), (state, first[burn_in:]))
    return jnp.concatenate([q_head, q])


def r2d2_loss(params, target_params, network, batch, args: Args, support=None):
    """R2D2's loss on a batch of sequences ([B, burn-in + seq-len + n, ...], SequenceReplay's) and
    each one's priority [B]: both networks unrolled from the stored state (the online one's burn-in
    without gradient), the squared (or Huber) error of h-scaled Q to r2d2_targets on the steps
    after the burn-in that start a transition (not an episode's last observation), averaged over
    each sequence, weighted by its importance weight. Returns (loss, (priorities, mean Q))."""
    # time-major
    seq = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), {k: batch[k] for k in SEQUENCE_FIELDS})
    ended = seq["terminated"] | seq["truncated"]
    # Row 0 starts from the stored state, which the actor had already reset if an episode started
    # there.
    first = jnp.concatenate([jnp.zeros_like(ended[:1]), ended[:-1]])
    q = unroll(network, params, seq["obs"], first, batch["memory"], args.burn_in)
    q_target = jax.lax.stop_gradient(
        unroll(network, target_params, seq["obs"], first, batch["memory"])
    )
    start, stop = args.burn_in, args.burn_in + args.seq_len
    targets = jax.lax.stop_gradient(
        r2d2_targets(
            q_target[start:],
            q[start:],
            seq["reward"][start:],
            seq["terminated"][start:],
            seq["truncated"][start:],
            args.gamma,
            args.n_step,
            args.double_dqn,
        )
    )
    q_taken = jnp.take_along_axis(
        q[start:stop], seq["action"][start:stop].astype(jnp.int32)[..., None], axis=-1
    )[..., 0]
    mask = 1.0 - ended[start:stop]
    errors = q_taken - targets
    losses = (
        optax.huber_loss(q_taken, targets, delta=args.huber_delta)
        if args.huber_delta
        else 0.5 * errors**2
    )
    per_sequence = jnp.sum(losses * mask, axis=0) / jnp.maximum(mask.sum(axis=0), 1)
    mean_q = jnp.sum(value_unrescale(q_taken) * mask) / jnp.maximum(mask.sum(), 1)
    return jnp.mean(batch["weights"] * per_sequence), (
        sequence_priorities(errors, mask, args.priority_eta),
        mean_q,
    )


def dqn_loss(params, target_params, network, batch, args: Args, support):
    """The importance-weighted loss of one batch and each transition's TD error [B] (the new
    priorities): Huber on the (Double) DQN target, or C51's cross-entropy to the projected target
    distribution (whose next action is picked by the expected values, the online network's with
    --double-dqn, as Rainbow does)."""
    q = network.apply(params, batch["obs"])
    next_target = network.apply(target_params, batch["next_obs"])
    next_online = network.apply(params, batch["next_obs"]) if args.double_dqn else next_target
    action = batch["action"].astype(jnp.int32)[:, None]
    # the masks stored with the transitions
    legal = legal_actions(network, batch["next_obs"], len(action))
    if args.c51:

        def values(logits):
            return jnp.sum(jax.nn.softmax(logits) * support, axis=-1)

        best = legal_argmax(values(next_online), legal)[:, None, None]
        next_probs = jax.nn.softmax(jnp.take_along_axis(next_target, best, axis=1)[:, 0])
        target = jax.lax.stop_gradient(
            c51_project(next_probs, batch["reward"], batch["discount"], support)
        )
        log_p = jax.nn.log_softmax(jnp.take_along_axis(q, action[..., None], axis=1)[:, 0])
        errors = -jnp.sum(target * log_p, axis=-1)
        q_taken, losses = jnp.sum(jnp.exp(log_p) * support, axis=-1), errors
    else:
        target = jax.lax.stop_gradient(
            q_targets(
                next_target, next_online, batch["reward"], batch["discount"], args.double_dqn, legal
            )
        )
        q_taken = jnp.take_along_axis(q, action, axis=-1)[:, 0]
        errors = q_taken - target
        losses = (
            optax.huber_loss(q_taken, target, delta=args.huber_delta)
            if args.huber_delta
            else 0.5 * errors**2
        )
    return jnp.mean(batch["weights"] * losses), (errors, q_taken)


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------


def make_greedy(network, c51: bool, support):
    """One jitted call: the greedy actions [B] of a batch of observations (C51: by the expected
    values), among the legal ones; with an LSTM, greedy(params, obs, core) -> (actions, the state
    after the step)."""

    @jax.jit
    def greedy(params, obs, core=None):
        q, state = (
            network.apply(params, obs, core)
            if network.lstm_size
            else (network.apply(params, obs), None)
        )
        values = jnp.sum(jax.nn.softmax(q) * support, axis=-1) if c51 else q
        action = legal_argmax(values, legal_actions(network, obs, len(q)))
        return (action, state) if network.lstm_size else action

    return greedy


def epsilon_greedy(greedy, params, obs, epsilon, num_actions: int, draws, legal=None):
    """ε-greedy actions [B] for `epsilon` [B], from the envs' uniforms `draws` [B, 2] (whether to
    explore, which action: among the `legal` ones [B, A], None: all): the draws on the host, and
    the network called only where an env acts greedily (as CleanRL's loop, which skips it while it
    explores)."""
    explore = draws[:, 0] < epsilon
    if legal is None:
        action = np.minimum((draws[:, 1] * num_actions).astype(np.int64), num_actions - 1)
    else:
        action = random_legal(legal, draws[:, 1])
    if explore.all():
        return action
    return np.where(explore, action, np.asarray(greedy(params, obs)))


def make_act(greedy, args: Args, network, streams: EnvStreams):
    """One actor thread's behaviour policy, act(params, obs, env_ids, steps, first) -> (actions,
    None): ε-greedy with each env's ε at the run's env step (epsilon_at; the envs' steps x the
    envs: as if they stepped in lockstep), each env's draws from its own stream, among the legal
    actions of `obs`. `first` (where an episode starts) is for make_recurrent_act's."""
    envs = devices.global_envs(args)

    def act(params, obs, env_ids, steps, first):
        epsilon = epsilon_at(args, int(steps.max()) * envs)[env_ids]
        legal = legal_actions(network, obs, len(env_ids))
        draws = streams.uniform(env_ids, steps)
        action = epsilon_greedy(greedy, params, obs, epsilon, network.action_dim, draws, legal)
        return action, None

    return act


def make_recurrent_act(greedy, args: Args, network, streams: EnvStreams):
    """--lstm: make_act's policy with a recurrent network, act(params, obs, env_ids, steps, first)
    -> (actions, states): each env's state (c, h) kept by env id and reset
    where its episode starts (`first`); the network runs for every env (its state moves on while
    it explores); the states returned are those it acted from, stored where sequences start."""
    memory, envs = zero_core(args.lstm_size, devices.local_envs(args))[0], devices.global_envs(args)

    def act(params, obs, env_ids, steps, first):
        state = jax.tree.map(
            lambda m: np.where(first[:, None], np.float32(0.0), m[env_ids]), memory
        )
        action, after = jax.device_get(greedy(params, obs, (state, first)))
        for m, s in zip(memory, after):
            m[env_ids] = s
        epsilon = epsilon_at(args, int(steps.max()) * envs)[env_ids]
        return epsilon_greedy(
            lambda *_: action,
            params,
            obs,
            epsilon,
            network.action_dim,
            streams.uniform(env_ids, steps),
        ), state

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
    state): ε-greedy at EVAL_EPSILON among the legal actions; its initial core (zero_core: with
    --lstm the state of zeros, else none), for a run's `build`; utils/evaluate.py calls it too."""
    network, _, support, _, _ = built
    greedy, streams = (
        make_greedy(network, args.c51, support),
        EnvStreams(args.seed + 10_000, 0, 100, 2),
    )

    def policy(params, obs, core, key, env_ids, steps):
        epsilon, draws = np.full(len(env_ids), EVAL_EPSILON), streams.uniform(env_ids, steps)
        legal = legal_actions(network, obs, len(env_ids))
        if core is None:
            return (
                epsilon_greedy(greedy, params, obs, epsilon, network.action_dim, draws, legal),
                None,
                None,
                None,
            )
        action, state = jax.device_get(greedy(params, obs, core))
        return (
            epsilon_greedy(
                lambda *_: action, params, obs, epsilon, network.action_dim, draws, legal
            ),
            None,
            None,
            state,
        )

    return policy, functools.partial(zero_core, network.lstm_size)


# ---------------------------------------------------------------------------------------------
# Learning
# ---------------------------------------------------------------------------------------------


def lr_fraction(args: Args, env_step):
    """The fraction of --learning-rate in the round that ends at env step `env_step`: with
    --anneal-lr, the budget's fraction left at the round's start (the first round learns at the
    full rate, the last at a round's worth)."""
    start = env_step - devices.global_envs(args) * args.num_steps
    return jnp.clip(1.0 - start / args.total_timesteps, 0.0, 1.0) if args.anneal_lr else 1.0


def make_update(network, optimizer, args: Args, support, mesh=None):
    """The jitted round, update(state, batches [S, batch, ...], step): the target network synced
    first where the round's env steps (up to `step`) crossed a multiple of
    --target-network-frequency, then one gradient step on each batch in turn. Returns the state
    and the diagnostics, with prioritised replay the TD errors [S, batch] (`priorities`; --lstm:
    each sequence's priority, whose mean is logged)."""
    round_steps = devices.global_envs(args) * args.num_steps

    def step(lr_scale, carry, batch):
        params, opt_state, target_params = carry
        if mesh is not None:  # each learner device takes its share of the batch: data parallel
            batch = jax.tree.map(
                lambda x: jax.lax.with_sharding_constraint(x, devices.split_envs(mesh, 0)), batch
            )
        (loss, (errors, q)), grads = jax.value_and_grad(
            r2d2_loss if args.lstm else dqn_loss, has_aux=True
        )(params, target_params, network, batch, args, support)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        if args.anneal_lr:  # Adam's step scaled: its learning rate times the budget's fraction left
            updates = jax.tree.map(lambda u: u * lr_scale, updates)
        params = optax.apply_updates(params, updates)
        return (params, opt_state, target_params), (
            {"loss": loss, "q_values": q.mean(), "grad_norm": optax.global_norm(grads)},
            errors,
        )

    @jax.jit
    def update(state, batches, env_step):
        sync = (
            env_step // args.target_network_frequency
            != (env_step - round_steps) // args.target_network_frequency
        )
        target = jax.tree.map(
            lambda p, t: jnp.where(sync, args.tau * p + (1 - args.tau) * t, t),
            state["params"],
            state["target_params"],
        )
        steps = jax.tree.leaves(batches)[0].shape[0]
        unroll = convolution.unrolled_scans(network.encoders, steps)  # native convs on a CPU
        (params, opt_state, target), (losses, errors) = jax.lax.scan(
            functools.partial(step, lr_fraction(args, env_step)),
            (state["params"], state["opt_state"], target),
            batches,
            unroll=unroll,
        )
        diagnostics = jax.tree.map(jnp.mean, losses)
        finite = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)]
        diagnostics["finite"] = jnp.isfinite(diagnostics["loss"]) & jnp.all(jnp.array(finite))
        if args.prioritized_replay:
            diagnostics["priorities"] = errors
        if args.lstm:
            diagnostics["replay/priority_mean"] = errors.mean()
        new_state = dict(
            state,
            params=params,
            opt_state=opt_state,
            target_params=target,
            policy_version=state["policy_version"] + 1,
        )
        return new_state, diagnostics

    return update


def learn_round(run, update, replay, chunks: list, rng, timing: dict):
    """The learner's round, the same in both modes: add each actor thread's chunk to the buffer
    (the learner owns it), then, once --learning-starts env steps are in (a resumed run refills
    its buffer first), sample the round's batches, compute their n-step targets, learn from them
    and write back their priorities; log the round. Returns the state."""
    args, state = run.args, run.state
    start = time.perf_counter()
    for chunk in chunks:
        replay.add(*chunk.rows)
    step = run.global_step + run.batch_size  # the env steps once this round is counted
    lag = [int(state["policy_version"]) - chunk.version for chunk in chunks]
    extra = {
        "async/policy_lag_mean": float(np.mean(lag)),
        "replay/fill": replay.fill,
        "charts/epsilon": float(np.mean(epsilon_at(args, step))),
    }
    if args.lstm:
        extra["replay/burn_in"] = args.burn_in
    diagnostics = {"finite": True}
    if step > run.start_step + args.learning_starts:
        num_batches = gradient_steps(args)
        beta = importance_exponent(args, step)
        batches = replay.sample(args.batch_size, rng, beta, num_batches)
        slots = batches.pop("slots")
        if not args.lstm:  # R2D2's targets are the loss's (r2d2_targets)
            rows = [batches.pop(key) for key in ("rewards", "terminated", "truncated")]
            batches["reward"], batches["discount"] = n_step_return(*rows, args.gamma)
        now = time.perf_counter()
        timing["replay"] += now - start
        state, diagnostics = update(state, devices.to_learner(run.mesh, batches), step)
        diagnostics = jax.device_get(diagnostics)
        if "priorities" in diagnostics:
            priorities = diagnostics.pop("priorities")
            replay.update_priorities(slots.ravel(), priorities.ravel())
        timing["update"] += time.perf_counter() - now
        sampled = num_batches * args.batch_size * sample_rows(args)
        extra["replay/ratio"] = sampled / run.batch_size
    else:
        state = dict(state, policy_version=state["policy_version"] + 1)
        timing["replay"] += time.perf_counter() - start
    learning_rate = args.learning_rate * float(lr_fraction(args, step))
    diagnostics = dict(diagnostics, learning_rate=learning_rate)
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
    """(network, optimizer, support, normalizer, initial state) of a run with these flags; a
    checkpoint restores into `dict(state, **normalizer.state())` (utils/evaluate.py does too)."""
    obs_space, action_space = (
        tasks.spaces(args.env_id)[0],
        tasks.policy_space(args.env_id),
    )  # a joint mask: the product
    network = QNetwork(
        int(action_space.n),
        tasks.encoders(obs_space),
        args.dueling,
        args.num_atoms if args.c51 else 0,
        args.action_mask and tasks.mask_shape(obs_space) is not None,
        args.lstm_size if args.lstm else 0,
    )
    params = network.init(
        key, tasks.zeros_like_space(obs_space, 1), *[zero_core(network.lstm_size, 1)] * args.lstm
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(args.max_grad_norm),
        optax.adam(args.learning_rate, eps=args.adam_eps),
    )
    support = jnp.linspace(args.v_min, args.v_max, args.num_atoms)
    normalizer = Normalizer(
        tasks.zeros_like_space(obs_space), devices.local_envs(args), False, False, args.gamma
    )
    state = {
        "params": params,
        "target_params": params,
        "opt_state": optimizer.init(params),
        "global_step": 0,
        "policy_version": 0,
    }
    return network, optimizer, support, normalizer, state


def make_replay(args: Args, obs_space, action_space):
    """The learner's buffer over all this process's envs; Atari's frame stacks stored a frame a row.
    --lstm: sequences of burn-in + seq-len + n-step rows, one every --seq-period with its state.
    `action_space`: the policy's (tasks.policy_space)."""
    stack = obs_space.shape[0] if tasks.env_kind(args.env_id) == "atari" else 1
    if args.lstm:
        return SequenceReplay(
            args.buffer_size,
            devices.local_envs(args),
            tasks.zeros_like_space(obs_space, 1),
            np.zeros(1, action_space.dtype),
            zero_core(args.lstm_size, 1)[0],
            args.burn_in + args.seq_len + args.n_step,
            args.seq_period,
            stack,
            args.priority_alpha if args.prioritized_replay else 0.0,
        )
    return Replay(
        args.buffer_size,
        devices.local_envs(args),
        tasks.zeros_like_space(obs_space, 1),
        np.zeros(1, action_space.dtype),
        args.n_step,
        stack,
        args.priority_alpha if args.prioritized_replay else 0.0,
    )


def main(args: Args, given=None) -> int:
    """Train; return the exit code. `given`: the flags named on the command line, which replace a
    resumed run's own (None: those that differ from Args' defaults)."""
    if args.distributed:  # refused before the Run joins any process
        raise UsageError(
            "--distributed: dqn_envpool.py learns in one process (its buffer is that process's)"
        )
    with runs.Run(args, given, __file__, resolve_args) as run:
        if run.finished:
            return 0
        args = run.args
        built = network, optimizer, support, normalizer, state = build(args, run.init_key)
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
        greedy = make_greedy(network, args.c51, support)
        shared = threads.Shared(
            state["params"],
            state["policy_version"],
            normalizer,
            run.sampled,
            run.stop,
            learning=not args.serial,
            keep=(args.actor_lag or 0) + 2,
        )
        make = make_recurrent_act if args.lstm else make_act
        acts = [
            make(greedy, args, network, EnvStreams(seed, i * args.num_envs, args.num_envs, 2))
            for i, (_, seed, _) in enumerate(actors)
        ]
        obs_space = tasks.spaces(args.env_id)[0]
        replay = make_replay(args, obs_space, tasks.policy_space(args.env_id))
        update = make_update(network, optimizer, args, support, run.mesh)
        sequences = (
            f", R2D2: sequences of {args.seq_len} after a burn-in of {args.burn_in}, one "
            f"every {args.seq_period} steps"
        )
        run.begin(
            f"preset {preset_name(args)}, {gradient_steps(args)} gradient steps a round"
            f"{sequences * args.lstm}{', serial' if args.serial else ''}",
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
