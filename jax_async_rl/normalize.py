"""Running normalisation of observations and rewards, as CleanRL's continuous-control PPO does
it with gym's wrappers (Huang et al. 2022, continuous-action details 5-8).

Observations become (obs - mean) / sqrt(var + 1e-8), clipped to [-10, 10]; rewards are divided
by the std of each env's discounted return, clipped to [-10, 10]. `Normalizer` keeps the
statistics on the host for the actors (`InTurn`: an actor thread's, when several must reproduce
under --deterministic); the functions below them are the same arithmetic on (mean, variance,
count) triples of numpy or jax.numpy arrays, for a normaliser inside a jitted loop
(appo_envpool_xla.py).
"""

import threading

import jax
import numpy as np


class Normalizer:
    """The statistics live on the host, move with training steps only and are checkpointed with
    the state; each is replaced whole, so another thread reads a consistent one, and actor threads
    update them one at a time, in the order their steps come (under --deterministic, several
    threads take turns instead: `in_turn`). With both switches off it passes everything through.
    """

    def __init__(self, obs, num_envs: int, norm_obs: bool, norm_reward: bool, gamma: float):
        self.norm_obs, self.norm_reward, self.gamma = norm_obs, norm_reward, gamma
        self.obs, self.num_envs = obs, num_envs  # `obs`: one observation (a pytree)
        self.lock = threading.Lock()
        # InTurn's: the threads' turns handed in, by (turn, thread), and how many turns are merged
        self.turns, self.merged = {}, 0
        self.turned = threading.Condition()  # notified as turns are merged
        self.reset()

    def reset(self):
        """The statistics before any sample (journal.replay rebuilds a resumed run's from there)."""
        zeros = jax.tree.map(lambda x: np.zeros(np.shape(x)), self.obs)
        self.obs_stats = (zeros, jax.tree.map(np.ones_like, zeros), 1e-4)  # mean, variance, count
        self.return_stats = (np.zeros(()), np.ones(()), 1e-4)
        self.returns = np.zeros(self.num_envs)  # discounted return of each env's episode so far

    @staticmethod
    def updated(stats, x):
        """(mean, variance, count) after adding the batch x [N, ...], a pytree (Chan et al.'s
        parallel update); one pass per leaf, plain ufuncs (np.var's wrapper cost the actor 10 µs a
        call)."""
        (mean, var, count), (leaves, tree) = stats, jax.tree.flatten(x)
        n = len(leaves[0])
        # no sample (an actor's batch of first observations, whose rewards are not a step's)
        if not n:
            return stats
        total, means, variances = count + n, [], []
        for leaf, m, v in zip(leaves, jax.tree.leaves(mean), jax.tree.leaves(var), strict=True):
            batch_mean = leaf.mean(0)
            delta = batch_mean - m
            batch_var = np.square(leaf - batch_mean).mean(0)
            means.append(m + delta * n / total)
            variances.append((v * count + batch_var * n + delta**2 * count * n / total) / total)
        return jax.tree.unflatten(tree, means), jax.tree.unflatten(tree, variances), total

    def observe(self, obs, train: bool = True):
        """Normalised observations [N, ...] (the float leaves; others pass); `train` also adds
        them to the statistics."""
        if not self.norm_obs:
            return obs
        if train:
            with self.lock:
                self.obs_stats = self.updated(self.obs_stats, obs)
        mean, var, _ = self.obs_stats
        return jax.tree.map(lambda x, m, v: scaled_obs(x, m, v, np), obs, mean, var)

    def reward(self, reward, done, env_ids):
        """Scaled rewards [N] of envs `env_ids`; `done` ends their discounted returns."""
        if not self.norm_reward:
            return reward
        with self.lock:
            self.returns[env_ids] = self.returns[env_ids] * self.gamma + reward
            self.return_stats = self.updated(self.return_stats, self.returns[env_ids])
            self.returns[env_ids[done]] = 0.0
        return scaled_reward(reward, self.return_stats[1], np)

    def snapshot(self):
        """(observation statistics, return statistics) as they are now, read together."""
        with self.lock:
            return self.obs_stats, self.return_stats

    def merge(self, new_obs, new_return):
        """Add statistics gathered elsewhere (another sampler's own samples: `combined`)."""
        with self.lock:
            if self.norm_obs:
                self.obs_stats = combined(self.obs_stats, new_obs)
            if self.norm_reward:
                self.return_stats = combined(self.return_stats, new_return)

    def in_turn(self, thread: int, num_envs: int, steps: int, stop):
        """What actor thread `thread` (`num_envs` envs, rollouts of `steps`) normalises with under
        --deterministic: with several threads an InTurn, so that no thread's statistics depend on
        when another's steps come; with one, or nothing normalised, this normaliser itself."""
        threads = self.num_envs // num_envs
        if threads < 2 or not (self.norm_obs or self.norm_reward):
            return self
        return InTurn(self, thread, threads, num_envs * steps, stop)

    def hand_in(self, turn: int, thread: int, threads: int, stats):
        """Thread `thread`'s (obs, return) statistics of its `turn`-th turn (InTurn), merged once
        every thread's are in: turn by turn, thread 0's first."""
        with self.turned:
            self.turns[turn, thread] = stats
            while all((self.merged, t) in self.turns for t in range(threads)):
                for t in range(threads):
                    self.merge(*self.turns.pop((self.merged, t)))
                self.merged += 1
            self.turned.notify_all()

    def after(self, turns: int, stop):
        """The statistics (snapshot) once `turns` turns of every thread are merged; as they are
        when `stop` is set first (the run is stopping: its actors learn nothing more)."""
        with self.turned:
            while self.merged < turns and not stop.is_set():
                self.turned.wait(0.1)
        return self.snapshot()

    def restart(self):
        """The statistics before any sample, and no turn merged (InTurn.reset)."""
        with self.turned:
            self.reset()
            self.merged = 0

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
            self.obs_stats = tuple(
                jax.tree.map(np.asarray, stats[f"obs_{k}"]) for k in ("mean", "var", "count")
            )
            self.return_stats = tuple(
                np.asarray(stats[f"return_{k}"]) for k in ("mean", "var", "count")
            )


class InTurn:
    """An actor thread's normaliser under --deterministic with several threads on one normaliser
    (`shared`; Normalizer.in_turn). The thread normalises with the statistics of every thread's
    samples up to its last turn, merged in thread order, plus its own since. Its turn ends every
    `size` observations (a rollout's worth, T x B: where, with the splits stepped in turn, its
    acting rollout changes): it hands its own statistics in and goes on from the merged ones once
    every thread's are in. What each thread sees is then the same in every run, whenever their
    steps come. The XLA actor's calls are its turns: `snapshot` before one, `merge` after."""

    def __init__(self, shared, thread: int, threads: int, size: int, stop):
        self.shared, self.thread, self.threads = shared, thread, threads
        self.size, self.stop = size, stop
        self.mine = self.fresh()  # what the thread normalises with
        self.own = self.fresh()  # its own samples' statistics, this turn
        self.seen = self.turn = 0  # observations, turns
        self.begin(shared.snapshot())

    def fresh(self) -> Normalizer:
        s = self.shared
        return Normalizer(s.obs, s.num_envs, s.norm_obs, s.norm_reward, s.gamma)

    def begin(self, stats):
        """A turn from the statistics `stats`, with none of its own yet (a count of 0)."""
        self.mine.obs_stats, self.mine.return_stats = stats
        empty = jax.tree.map(np.zeros_like, stats)
        self.own.obs_stats, self.own.return_stats = empty

    def observe(self, obs, train: bool = True):
        """Normalizer.observe; a batch after `size` observations ends the turn first."""
        if train:
            if self.seen // self.size > self.turn:
                self.merge(*self.own.snapshot())
                self.begin(self.snapshot())
            self.seen += len(jax.tree.leaves(obs)[0])
            self.own.observe(obs)
        return self.mine.observe(obs, train)

    def reward(self, reward, done, env_ids):
        """Normalizer.reward (the returns of this thread's envs are its own)."""
        self.own.reward(reward, done, env_ids)
        return self.mine.reward(reward, done, env_ids)

    def snapshot(self):
        """The statistics the thread's next turn starts from: every thread's up to it, merged."""
        return self.shared.after(self.turn, self.stop)

    def merge(self, new_obs, new_return):
        """The statistics of the thread's own samples this turn, handed in; the turn ends."""
        self.shared.hand_in(self.turn, self.thread, self.threads, (new_obs, new_return))
        self.turn += 1

    def reset(self):
        """journal.replay's start: every thread's statistics are rebuilt from the first sample, so
        the merged turns start again too."""
        self.shared.restart()
        self.mine.reset()
        self.own.reset()
        self.seen = self.turn = 0
        self.begin(self.mine.snapshot())


def scaled_obs(x, mean, var, xp):
    """One observation leaf normalised (`xp`: numpy or jax.numpy); non-float leaves pass."""
    if not xp.issubdtype(x.dtype, xp.floating):
        return x
    return xp.minimum(xp.maximum((x - mean) / xp.sqrt(var + 1e-8), -10), 10).astype(xp.float32)


def scaled_reward(reward, return_var, xp):
    """Rewards divided by the std of the discounted return, clipped (`xp`: numpy or jax.numpy)."""
    return xp.minimum(xp.maximum(reward / xp.sqrt(return_var + 1e-8), -10), 10).astype(xp.float32)


def moments(x):
    """(mean, variance, count) of a batch x [N, ...], a pytree of numpy or jax.numpy arrays."""
    mean = jax.tree.map(lambda leaf: leaf.mean(0), x)
    var = jax.tree.map(lambda leaf, m: ((leaf - m) ** 2).mean(0), x, mean)
    return mean, var, len(jax.tree.leaves(x)[0])


def combined(a, b):
    """The (mean, variance, count) of two sets of samples from theirs (Chan et al.), leaf by leaf:
    numpy on the host, jax.numpy in a jitted loop."""
    (mean_a, var_a, n_a), (mean_b, var_b, n_b) = a, b
    n = n_a + n_b
    mean = jax.tree.map(lambda ma, mb: ma + (mb - ma) * n_b / n, mean_a, mean_b)
    var = jax.tree.map(
        lambda ma, va, mb, vb: (va * n_a + vb * n_b + (mb - ma) ** 2 * n_a * n_b / n) / n,
        mean_a,
        var_a,
        mean_b,
        var_b,
    )
    return mean, var, n
