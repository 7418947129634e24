"""The replay families' storage (DQN; SAC, TD3), host arrays: the buffer, owned by the learner,
and an actor thread's chunk on its way to it (`Collecting`, `Chunk`).

One row per env step, exactly what the env returned and what the actor did with it:
`(obs_t, action_t, reward_t, terminated_t, truncated_t, elapsed_t)`, where the reward and the
flags are those of the step that produced `obs_t` (envpool's return), and `action_t` the action
taken on it. Rows are kept per env (a ring of `capacity // num_envs` rows for each env id), so
that splits that step out of turn (double buffering) each write their own envs' rows.

A transition starts at row t when `obs_t` is not an episode's last observation (envpool's
autoreset ignores the action taken on that one). Its target needs rows t+1 .. t+n: the buffer
hands them over as they are (rewards, terminations, truncations) with the observation where the
window ends, at the first of those rows that ends the episode, else n rows on (a truncated
episode's last observation is the real one). The script computes the target from them
(dqn_envpool.py's `n_step_return`: the return, and the discount of the bootstrap).

Stacked frames (`frame_stack` > 1, Atari's `[4, 84, 84]`) are stored one frame a row, the newest,
and the stack is rebuilt when sampling: frame j of `obs_t` is the newest frame of row
`t - min(stack - 1 - j, elapsed_t)`, because envpool starts an episode's stack with copies of its
first frame. 1M Atari rows take 1M x (84 x 84 + 11) bytes, 7.07 GB (whole stacks: 28 GB).
The legal actions of an observation (its "action_mask" leaf) are stored as bits, 8 actions a byte,
and given back in the env's shape and dtype.

`live` marks the slots that start a complete transition. Uniform replay draws them with
replacement (slots drawn over the ring, those not live drawn again); prioritised replay (Schaul
et al. 2016, proportional: `(|td| + eps)^alpha`, new transitions the largest so far) samples down
a sum tree over every slot, vectorised per level (no Python loop per sample), stratified.
"""

import math
from typing import NamedTuple

import numpy as np
import jax

from jax_async_rl import devices, tasks
from jax_async_rl.flags import UsageError
from jax_async_rl.tasks import MASK


def check_rounds(args, min_rows: int):
    """The flags of a replay script's rounds (each actor thread's chunk of --num-steps steps of its
    --num-envs envs, then --replay-ratio x the round / --batch-size gradient steps), checked:
    UsageError, one line. `min_rows`: the rows each env's ring must hold beyond that (n-step +
    stack). When a run starts (not utils/evaluate.py, which allocates no buffer), the buffer and a
    round's batches must fit in 90% of the memory available (the rest is the run's own: JAX, the
    envs)."""
    if args.num_envs % args.num_splits:
        raise UsageError(f"--num-splits {args.num_splits} must divide --num-envs {args.num_envs}")
    chunk, per = devices.global_envs(args) * args.num_steps, sample_rows(args)
    steps = args.replay_ratio * chunk / (args.batch_size * per)
    if steps < 1 or abs(steps - round(steps)) > 1e-6:
        rows = (
            f" x {per} steps a sequence (--burn-in + --seq-len)"
            if getattr(args, "lstm", False)
            else ""
        )
        raise UsageError(
            f"--replay-ratio {args.replay_ratio} x a round's {chunk} env steps "
            f"({devices.describe_batch(args)}) "
            f"/ --batch-size {args.batch_size}{rows} = {steps:g} gradient steps: make it a whole "
            f"number"
        )
    if args.batch_size % len(args.learner_device_ids):
        raise UsageError(
            f"--batch-size {args.batch_size} must divide over the {len(args.learner_device_ids)} "
            f"learner devices"
        )
    if args.buffer_size < 2 * chunk or args.buffer_size // devices.local_envs(args) <= min_rows:
        raise UsageError(
            f"--buffer-size {args.buffer_size} must hold two rounds ({chunk} env steps) and more "
            f"than "
            f"{min_rows} steps of each of the {devices.local_envs(args)} envs"
        )
    check_first_sample(args, chunk)
    if tasks.RUN_STOP[0] is None:  # utils/evaluate.py: no buffer
        return
    available = devices.available_memory()
    if available is None:
        return
    obs_space, action_space = tasks.spaces(args.env_id)
    obs = sum(
        np.dtype(s.dtype).itemsize * math.prod(s.shape)
        for s in jax.tree.leaves(tasks.space_tree(obs_space))
    )
    # frames stored once (the docstring)
    stack = obs_space.shape[0] if tasks.env_kind(args.env_id) == "atari" else 1
    action = np.dtype(action_space.dtype).itemsize * math.prod(action_space.shape or ())
    rows = args.buffer_size // devices.local_envs(args) * devices.local_envs(args)
    # the reward, terminated, truncated and the stack's reach back
    row = obs // stack + action + 4 + 3
    # obs and next obs; the window's n rewards (4 bytes), terminations and truncations (1 each);
    # the slot (8) and the weight (4)
    sample = 2 * obs + action + 6 * getattr(args, "n_step", 1) + 12
    # R2D2: a state stored every --seq-period rows; a sample: a window and a state
    if getattr(args, "lstm", False):
        row += 8 * args.lstm_size / args.seq_period
        sample = (per + args.n_step) * (obs + action + 6) + 8 * args.lstm_size + 16
    # the sum tree: 2 float64 a leaf
    buffer = rows * row + 16 * 2 ** max(1, math.ceil(math.log2(rows)))
    batches = round(steps) * args.batch_size * sample
    if buffer + batches > 0.9 * available:
        flag, what = (
            (f"--buffer-size {args.buffer_size:,}", f"its {rows:,} rows of {row:,} bytes")
            if buffer >= batches
            else (f"--replay-ratio {args.replay_ratio:g}", f"a round's {round(steps):,} batches")
        )
        raise UsageError(
            f"{flag}: the replay buffer and a round's batches take "
            f"{(buffer + batches) / 2**30:.1f} GiB ({what}"
            f"{', Atari frames stored once' if stack > 1 else ''}), more than 90% of the "
            f"{available / 2**30:.1f} GiB this machine has available; lower {flag.split()[0]}"
        )


def check_first_sample(args, chunk: int):
    """UsageError, one line, where the first round that learns (the first past --learning-starts,
    counted from an empty buffer: a resumed run refills it) finds no complete transition (its
    --n-step rows after it) or, with --lstm, no whole sequence (--burn-in + --seq-len + --n-step
    rows) in any env: each env has stepped --num-steps a round by then, on average."""
    n = getattr(args, "n_step", 1)
    lstm = getattr(args, "lstm", False)
    need = args.burn_in + args.seq_len + n if lstm else n + 1
    rounds = args.learning_starts // chunk + 1
    if rounds * args.num_steps >= need:
        return
    what, fix = (
        (
            f"a sequence of --burn-in {args.burn_in} + --seq-len {args.seq_len} + --n-step {n}",
            "shorten the sequences",
        )
        if lstm
        else (f"a transition and its --n-step {n}", "lower --n-step")
        if hasattr(args, "n_step")
        else ("a transition and the next", "raise --num-steps")
    )
    raise UsageError(
        f"--learning-starts {args.learning_starts} learns first in round {rounds}, after "
        f"{rounds * args.num_steps} "
        f"steps of each env (--num-steps {args.num_steps} a round), and {what} needs {need} steps "
        f"of an env: raise "
        f"--learning-starts to {(-(-need // args.num_steps) - 1) * chunk}, or {fix}"
    )


def gradient_steps(args) -> int:
    """Gradient steps of each round: --replay-ratio x the round's env steps / (--batch-size x
    sample_rows)."""
    return round(
        args.replay_ratio
        * devices.global_envs(args)
        * args.num_steps
        / (args.batch_size * sample_rows(args))
    )


def sample_rows(args) -> int:
    """The env steps one sample counts for the replay ratio: a transition's 1, or with --lstm
    (R2D2's sequences) its burn-in and learned steps (rlpyt's R2D1 counts both)."""
    return args.burn_in + args.seq_len if getattr(args, "lstm", False) else 1


class Chunk(NamedTuple):
    """What an actor thread hands the learner each round."""

    rows: tuple  # Replay.add's arguments (SequenceReplay's: and the states), env by env in order
    version: int  # the parameters' that acted on it
    games: list  # the games that ended in it (tasks.EpisodeStats)


class Collecting:
    """An actor thread's storage between rounds: the rows of the chunk it is collecting, and what
    each of its envs carries from chunk to chunk: its steps over the run (from `first_step`),
    whether its next observation starts an episode (`starts`), its games so far (`stats`). Env
    ids are the thread's own; the rows count them over the process's actor threads (+ `offset`)."""

    def __init__(self, num_envs: int, offset: int, first_step: int):
        self.offset = offset
        self.steps = np.full(num_envs, first_step, np.int64)
        self.starts = np.ones(num_envs, bool)
        self.stats = tasks.EpisodeStats(num_envs)
        self.rows = []

    def append(self, env_ids, obs, action, reward, terminated, truncated, elapsed, state=None):
        """One split's step: a row of each env, with the action taken on its observation (and
        with a recurrent policy the state it acted from)."""
        row = (env_ids + self.offset, obs, action, reward, terminated, truncated, elapsed)
        self.rows.append(row if state is None else (*row, state))
        self.steps[env_ids] += 1
        self.starts[env_ids] = terminated | truncated

    def pop(self, version: int) -> Chunk:
        """The chunk collected, its rows concatenated (one Replay.add); the next starts empty."""
        rows = jax.tree.map(lambda *xs: np.concatenate(xs), *self.rows)
        self.rows = []
        return Chunk(rows, version, self.stats.pop())


class SumTree:
    """Sums over `capacity` leaves in a flat binary tree (root at 1); `update` and `find` work on
    whole batches, one numpy operation per level."""

    def __init__(self, capacity: int):
        self.depth = max(1, int(np.ceil(np.log2(capacity))))
        self.leaves = 1 << self.depth
        self.capacity = capacity
        self.tree = np.zeros(2 * self.leaves, np.float64)

    @property
    def total(self) -> float:
        return float(self.tree[1])

    def get(self, indices) -> np.ndarray:
        return self.tree[self.leaves + np.asarray(indices)]

    def update(self, indices, values):
        """Set leaves (the last value wins for a repeated index) and every sum above them."""
        nodes = self.leaves + np.asarray(indices, np.int64).ravel()
        if not len(nodes):
            return
        self.tree[nodes] = values
        for _ in range(self.depth):  # a parent repeated in `nodes` gets the same sum twice
            nodes //= 2
            self.tree[nodes] = self.tree[2 * nodes] + self.tree[2 * nodes + 1]

    def find(self, targets) -> np.ndarray:
        """For each target in [0, total): the leaf whose prefix-sum interval holds it."""
        targets = np.array(targets, np.float64)
        nodes = np.ones(len(targets), np.int64)
        while nodes[0] < self.leaves:
            left = self.tree[2 * nodes]
            # Right only into a subtree with mass: rounding at an interval's edge never lands on
            # an empty leaf.
            right = (targets >= left) & (self.tree[2 * nodes + 1] > 0)
            targets = np.where(right, targets - left, np.minimum(targets, left))
            nodes = 2 * nodes + right
        return nodes - self.leaves


class Replay:
    """Rows `[capacity // num_envs, num_envs]` of each field; see the module docstring.
    `obs_example` and `action_example` are batches as the env takes and returns them.

    `add(env_ids, obs, action, reward, terminated, truncated, elapsed)` writes one row for each
    of `env_ids` (a split's batch, as the env returned it, with the actor's actions);
    `sample(batch_size, rng)` returns a dict of `obs`, `action`, the next n rows' `rewards`,
    `terminated` and `truncated` ([..., n]), `next_obs` (where the window ends: see the module
    docstring), `slots` and `weights` (importance weights, 1 under uniform replay);
    `update_priorities(slots, td_errors)` under prioritised replay."""

    def __init__(
        self,
        capacity: int,
        num_envs: int,
        obs_example,
        action_example,
        n_step: int = 1,
        frame_stack: int = 1,
        alpha: float = 0.0,
        eps: float = 1e-6,
    ):
        if capacity < num_envs:
            raise ValueError(
                f"a buffer of {capacity} transitions cannot hold a row of {num_envs} envs"
            )
        self.capacity, self.rows, self.num_envs = capacity, capacity // num_envs, num_envs
        self.n_step = n_step
        self.stack = frame_stack
        self.alpha = alpha
        self.eps = eps
        if self.rows < n_step + frame_stack + 1:
            raise ValueError(
                f"{self.rows} rows an env is too few for n-step {n_step} with {frame_stack} frames"
            )

        def storage(example, frames=False):  # example: a batch, as the env returns it
            example = np.asarray(example)
            return np.zeros(
                (self.rows, num_envs, *example.shape[2 if frames else 1 :]), example.dtype
            )

        leaves, tree = jax.tree_util.tree_flatten_with_path(obs_example)
        self.bits = {
            i: (np.shape(x)[1:], np.asarray(x).dtype)
            for i, (path, x) in enumerate(leaves)  # masks' leaves
            if path and getattr(path[-1], "key", None) == MASK
        }
        self.obs = jax.tree.unflatten(
            tree,
            [
                storage(x, frame_stack > 1)
                if i not in self.bits
                else storage(np.zeros((1, -(-np.size(x[0]) // 8)), np.uint8))  # bytes of bits
                for i, (_, x) in enumerate(leaves)
            ],
        )
        self.action = storage(action_example)
        self.reward = np.zeros((self.rows, num_envs), np.float32)
        self.terminated = np.zeros((self.rows, num_envs), bool)
        self.truncated = np.zeros((self.rows, num_envs), bool)
        self.back = np.zeros((self.rows, num_envs), np.uint8)  # min(elapsed, stack - 1)
        self.count = np.zeros(num_envs, np.int64)  # rows written to each env
        self.live = np.zeros(self.rows * num_envs, bool)  # slots that start a complete transition
        self.tree = SumTree(self.rows * num_envs) if alpha else None  # prioritised replay's
        self.max_priority = 1.0

    def __len__(self) -> int:
        """Complete transitions that can be sampled."""
        return int(np.count_nonzero(self.live))

    @property
    def transitions(self) -> int:
        """Rows written, over all envs (the env steps stored so far, old ones overwritten)."""
        return int(self.count.sum())

    def slot(self, t, e):
        return (t % self.rows) * self.num_envs + e

    @property
    def fill(self) -> float:
        """The fraction of the buffer that can be sampled (logged as replay/fill)."""
        return len(self) / self.capacity

    def add(self, env_ids, obs, action, reward, terminated, truncated, elapsed):
        """Write one row for each of `env_ids`: one split's step, or a whole chunk of them, where
        an env's rows come in the order it stepped (the k-th row of env e goes to its row
        count[e] + k). One call for a chunk pays numpy's per-call cost once."""
        t, e = self.write(env_ids, obs, action, reward, terminated, truncated, elapsed)
        # A written row can no longer start a transition, nor can the rows whose stack reaches
        # back to the one it overwrote; the row n before it now has its whole n-step target, and
        # starts one unless the call overwrote it or a row its stack reaches back to.
        stale = np.concatenate([self.slot(t + k, e) for k in range(self.stack)])
        start = t - self.n_step
        ready = (start >= 0) & (start >= self.count[e] - self.rows + self.stack - 1)
        start, ready_e = start[ready], e[ready]
        ended = (
            self.terminated[start % self.rows, ready_e] | self.truncated[start % self.rows, ready_e]
        )
        fresh = self.slot(start[~ended], ready_e[~ended])
        self.live[stale], self.live[fresh] = False, True
        if self.tree is not None:
            self.tree.update(
                np.concatenate([stale, fresh]),
                np.r_[np.zeros(len(stale)), np.full(len(fresh), self.max_priority**self.alpha)],
            )

    def write(self, env_ids, obs, action, reward, terminated, truncated, elapsed):
        """`add`'s rows, written; returns each one's (row number, env id)."""
        e = np.asarray(env_ids, np.int64)
        order = np.argsort(e, kind="stable")
        before = np.empty_like(e)
        # its env's rows before it
        before[order] = np.arange(len(e)) - np.searchsorted(e[order], e[order])
        t = self.count[e] + before
        rows = t % self.rows
        for i, (store, value) in enumerate(zip(jax.tree.leaves(self.obs), jax.tree.leaves(obs))):
            value = np.asarray(value)
            if i in self.bits:
                value = np.packbits(value.reshape(len(value), -1) > 0, axis=-1)
            store[rows, e] = value[:, -1] if self.stack > 1 else value
        self.action[rows, e] = action
        self.reward[rows, e] = reward
        self.terminated[rows, e] = terminated
        self.truncated[rows, e] = truncated
        self.back[rows, e] = np.minimum(np.asarray(elapsed), self.stack - 1)
        self.count += np.bincount(e, minlength=self.num_envs)
        return t, e

    def row_of(self, slots):
        """(row number, env id) of slots: the newest row of the env kept in each."""
        t_mod, e = np.divmod(np.asarray(slots, np.int64), self.num_envs)
        return self.count[e] - 1 - (self.count[e] - 1 - t_mod) % self.rows, e

    def stacked(self, t, e):
        """The observations of rows t of envs e, their frame stacks rebuilt."""
        if self.stack == 1:
            return self.read((t % self.rows, e))
        back = self.back[t % self.rows, e].astype(np.int64)[:, None]
        rows = (
            t[:, None] - np.minimum(np.arange(self.stack - 1, -1, -1), back)
        ) % self.rows  # [B, stack]
        return self.read((rows, e[:, None]))

    def read(self, index):
        """Every observation leaf at `index` (rows and envs), masks unpacked from their bits."""
        out = [store[index] for store in jax.tree.leaves(self.obs)]
        for i, (shape, dtype) in self.bits.items():
            size = int(np.prod(shape))
            out[i] = (
                np.unpackbits(out[i], axis=-1, count=size)
                .reshape(*out[i].shape[:-1], *shape)
                .astype(dtype)
            )
        return jax.tree.unflatten(jax.tree.structure(self.obs), out)

    def sample(
        self, batch_size: int, rng: np.random.Generator, beta: float = 0.0, num_batches: int = 0
    ):
        """One batch, or with `num_batches` that many [num_batches, batch_size, ...] drawn at once
        (a learner's round: the numpy calls are paid once)."""
        count = batch_size * max(num_batches, 1)
        if not self.live.any():
            raise RuntimeError("sample from a replay buffer without a complete transition")
        if self.tree is not None:
            # Stratified, as in Schaul et al.: one target in each of `count` equal segments,
            # shuffled so that each batch spans the whole buffer; one pass down the tree.
            targets = (np.arange(count) + rng.random(count)) * (self.tree.total / count)
            slots = self.tree.find(rng.permutation(targets) if num_batches else targets)
        else:
            slots = self.uniform_slots(count, rng)
        batch = self.gather(slots, beta)
        if num_batches:
            batch = jax.tree.map(lambda x: x.reshape(num_batches, batch_size, *x.shape[1:]), batch)
        # rlpyt: importance weights normalised by the largest of their batch
        batch["weights"] = (batch["weights"] / batch["weights"].max(axis=-1, keepdims=True)).astype(
            np.float32
        )
        return batch

    def uniform_slots(self, count: int, rng: np.random.Generator):
        """`count` complete transitions drawn uniformly, with replacement (as CleanRL's and rlpyt's
        uniform buffers): slots drawn over the whole ring and those that start no transition
        redrawn, a few times cheaper than a pass down the tree."""
        accept, slots = len(self) / len(self.live), np.empty(0, np.int64)
        while len(slots) < count:
            drawn = rng.integers(0, len(self.live), int((count - len(slots)) / accept * 1.1) + 16)
            slots = np.concatenate([slots, drawn[self.live[drawn]]])
        return slots[:count]

    def gather(self, slots, beta: float):
        """The transitions starting at `slots`: their rows, the next n rows' rewards and flags, the
        observation where their window ends, importance weights."""
        t, e = self.row_of(slots)
        window = (t[:, None] + np.arange(1, self.n_step + 1)) % self.rows  # [B, n]
        terminated = self.terminated[window, e[:, None]]
        truncated = self.truncated[window, e[:, None]]
        ends = terminated | truncated
        # The first row that ends the episode, else the n-th.
        last = np.where(ends.any(axis=1), np.argmax(ends, axis=1), self.n_step - 1)
        return dict(
            obs=self.stacked(t, e),
            action=self.action[t % self.rows, e],
            rewards=self.reward[window, e[:, None]],
            terminated=terminated,
            truncated=truncated,
            next_obs=self.stacked(t + 1 + last, e),
            slots=slots,
            weights=self.weights(slots, beta),
        )

    def weights(self, slots, beta: float):
        """Prioritised replay's importance weights (N P(slot))^-beta (1 without; normalised by
        `sample`)."""
        if self.tree is None or not beta:
            return np.ones(len(slots), np.float32)
        return (len(self) * (self.tree.get(slots) / self.tree.total)) ** -beta

    def update_priorities(self, slots, td_errors):
        priorities = np.abs(np.asarray(td_errors, np.float64)) + self.eps
        self.max_priority = max(self.max_priority, float(priorities.max()))
        live = self.live[slots]  # a slot overwritten since it was sampled stays out
        self.tree.update(np.asarray(slots)[live], priorities[live] ** self.alpha)
