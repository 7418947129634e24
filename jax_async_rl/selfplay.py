"""Self-play on envpool's turn-based multi-player games (board games, poker, mahjong): the game
seen from one seat, the learner's, with the other seats played by opponents.

- `SeatPool` wraps one multi-player envpool (sync or async) behind the one-agent interface the
  scripts step: one observation, reward and done per env, from the learner's seat. At an
  opponent's turn it replaces the action the script sent with the opponent's move, so the script's
  loop stays the one-agent loop; `turns` says which envs' observations are the learner's moves.
- `Opponents` picks who plays the other seats of each game (`--opponent-mix`: the latest
  parameters, a past snapshot, a uniform random legal player) and plays them: one batched call of
  the script's policy per kind that moves.
- `Pool` keeps the past snapshots (every `--opponent-snapshot-interval` updates, the newest
  `--opponent-pool-size`); it is checkpointed with the run (msgpack arrays: no pickle).
- `decisions` turns a rollout of env steps into one of the learner's decisions (see its doc);
  `WinRates` keeps the training games' outcomes by opponent for the logs.

Storage and env plumbing only: what the learner learns from a rollout is the script's.
"""

import collections
import threading

import gymnasium
import jax
import numpy as np

from jax_async_rl.flags import UsageError

KINDS = ("latest", "past", "random")
# A rollout's time-major arrays (trajectories.Rollout's, the sync script's dict's).
TIME_MAJOR = (
    "obs",
    "actions",
    "logprobs",
    "values",
    "rewards",
    "dones",
    "truncated",
    "valid",
    "policy_version",
)


def uniform(seed, a, b):
    """Floats in [0, 1), one per element of the integer arrays `a` and `b`, a fixed function of
    (seed, a, b) (splitmix64): draws that depend on no thread's timing."""
    with np.errstate(over="ignore"):
        x = np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
        x = x + np.asarray(a, np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
        x = x + np.asarray(b, np.uint64) * np.uint64(0x94D049BB133111EB)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / 2.0**53


def random_legal(masks, u):
    """The uniform random player: for each row of `masks` [N, A], the legal action that the draw
    `u` [N] in [0, 1) picks."""
    legal = masks.astype(bool)
    k = np.floor(u * legal.sum(axis=1)).astype(np.int64)
    return np.argmax(np.cumsum(legal, axis=1) > k[:, None], axis=1)


def check_game(env_id: str, num_players: int, info: dict):
    """A UsageError message for a multi-player game --self-play cannot take, else None: one whose
    players move at once (no info["current_player"]) or that has no legal-action mask."""
    if "current_player" not in info:
        return (
            f"--env-id {env_id}: its {num_players} players move at once (it has no "
            "info['current_player']); --self-play takes turn-based games"
        )
    if "legal_action_mask" not in info:
        return f"--env-id {env_id} has no info['legal_action_mask']; --self-play needs one"
    return None


def check_args(args):
    """UsageError, one line, for --self-play flags that do not go together."""
    mix = np.asarray(args.opponent_mix, np.float64)
    if (mix < 0).any() or abs(mix.sum() - 1) > 1e-6:
        raise UsageError(
            f"--opponent-mix {' '.join(map(str, args.opponent_mix))}: fractions of games (latest, "
            "past, random), each at least 0, that sum to 1"
        )
    if args.lstm:
        raise UsageError("--self-play takes no --lstm: its rollouts are reordered by decision")
    if not args.action_mask:
        raise UsageError("--self-play plays legal moves only: drop --no-action-mask")
    if args.deterministic and args.resume:
        raise UsageError(
            "--resume of a --deterministic --self-play run is not built: its journal holds the "
            "learner's actions, not its opponents'; resume without --deterministic"
        )


def seat_spaces(obs_space, action_space):
    """(observation space, action space) from the learner's seat: a Dict of one player's
    observation ("obs") and the mover's legal actions ("action_mask", which the scripts apply)."""
    mask = gymnasium.spaces.MultiBinary(int(action_space.n))
    return gymnasium.spaces.Dict({"obs": obs_space, "action_mask": mask}), action_space


class SeatPool:
    """A turn-based multi-player envpool seen from the learner's seat (see the module doc).

    envpool returns one observation and reward row per (env, player) (`info["players"]`), the
    player to move (`info["current_player"]`), the mover's legal actions and one done per env, and
    takes one action per env, the mover's. Here env e's n-th game seats the learner `(e + n) % P`
    places after the game's first mover (P players), so that it moves first, second, ... in turn;
    the reward it returns is the learner's seat's, and `turns` is 1 where the learner is to move.
    Env e's draws (opponent kind, random moves) are keyed by `seed + e`, as envpool seeds it.
    `opponents` (an `Opponents`, set by the script or evaluation): who plays the other seats; None:
    the uniform random player. `illegal` counts moves sent that the mover's mask forbids."""

    def __init__(self, pool, num_envs: int, num_players: int, seed: int, opponents=None):
        self.pool, self.num_envs, self.seed = pool, num_envs, seed
        self.players, self.opponents, self.illegal = num_players, opponents, 0
        self.observation_space, self.action_space = seat_spaces(
            pool.observation_space, pool.action_space
        )
        self.seat = np.zeros(num_envs, np.int64)  # the learner's player id in the current game
        self.place = np.zeros(num_envs, np.int64)  # its place in the turn order (0: moves first)
        self.kind = np.full(num_envs, KINDS.index("random"))  # the opponents of the current game
        self.games = np.zeros(num_envs, np.int64)  # games started
        self.steps = np.zeros(num_envs, np.int64)  # actions sent
        self.mover = np.zeros(num_envs, np.int64)
        self.turns = np.zeros(num_envs, np.float32)
        self.ended = np.zeros(num_envs, bool)  # the last step ended the game (the next resets)
        self.masks = np.zeros((num_envs, self.action_space.n), np.int8)
        self.views = None  # [num_envs, ...]: the mover's observation, for its opponents
        self.outcomes = []  # (opponent kind, learner's place, its reward) of each game that ended

    def seen(self, obs, reward, terminated, truncated, info):
        """What envpool returned for the envs info["env_id"], from the learner's seat."""
        ids = np.asarray(info["env_id"])
        n = len(ids)
        where = np.zeros(self.num_envs, np.int64)
        where[ids] = np.arange(n)
        rows, players = where[info["players"]["env_id"]], info["players"]["id"]
        views = np.zeros((n, self.players, *obs.shape[1:]), obs.dtype)
        views[rows, players] = obs
        rewards = np.zeros((n, self.players), np.float32)
        rewards[rows, players] = reward
        mine = rewards[np.arange(n), self.seat[ids]]  # the step's reward at the learner's seat
        done = np.asarray(terminated) | np.asarray(truncated)
        for i in np.flatnonzero(done):
            e = ids[i]
            self.outcomes.append((KINDS[self.kind[e]], int(self.place[e]), float(mine[i])))
        mover = np.asarray(info["current_player"], np.int64)
        new = ids[info["elapsed_step"] == 0]  # a game's first observation
        if len(new):
            place = (new + self.games[new]) % self.players
            self.place[new], self.seat[new] = place, (mover[where[new]] + place) % self.players
            if self.opponents is not None:
                self.kind[new] = self.opponents.draw(self.seed + new, self.games[new])
            self.games[new] += 1
        self.mover[ids], self.ended[ids] = mover, done
        self.turns[ids] = self.mover[ids] == self.seat[ids]
        self.masks[ids] = info["legal_action_mask"]
        if self.views is None:
            self.views = np.zeros((self.num_envs, *obs.shape[1:]), obs.dtype)
        self.views[ids] = views[np.arange(n), mover]
        own = {"obs": views[np.arange(n), self.seat[ids]], "action_mask": self.masks[ids]}
        info = {k: v for k, v in info.items() if k != "players"}
        info.update(opponent=self.kind[ids], seat=self.place[ids])
        return own, mine, terminated, truncated, info

    def send(self, action, env_ids):
        """Send the learner's `action` where it is to move and its opponents' moves elsewhere."""
        env_ids = np.asarray(env_ids)
        action = np.array(action, dtype=np.int64)
        theirs = self.turns[env_ids] == 0
        if theirs.any() and self.views is not None:
            action[theirs] = self.opponent_moves(env_ids)[theirs]
        acting = ~self.ended[env_ids]  # a reset step's action is ignored
        legal = self.masks[env_ids, action] > 0
        self.illegal += int((acting & ~legal).sum())
        self.steps[env_ids] += 1
        self.pool.send(action.astype(self.pool.action_space.dtype), env_ids)

    def opponent_moves(self, env_ids):
        """The moves of whoever plays the mover's seat in each of `env_ids` (learner's seats too:
        the caller keeps the ones it needs)."""
        keys = self.seed + env_ids
        moves = random_legal(self.masks[env_ids], uniform(self.seed, keys, self.steps[env_ids]))
        if self.opponents is None:
            return moves
        obs = {"obs": self.views[env_ids], "action_mask": self.masks[env_ids]}
        theirs = self.turns[env_ids] == 0
        for k, kind in enumerate(KINDS[:2]):
            playing = theirs & (self.kind[env_ids] == k)
            if playing.any():
                played = self.opponents.act(kind, obs, keys, self.steps[env_ids])
                moves[playing] = played[playing]
        return moves

    def recv(self):
        return self.seen(*self.pool.recv())

    def async_reset(self):
        self.pool.async_reset()

    def reset(self):
        obs, info = self.pool.reset()
        no_step = np.zeros(len(info["env_id"]), bool)
        obs, _, _, _, info = self.seen(obs, np.zeros(len(obs), np.float32), no_step, no_step, info)
        return obs, info

    def step(self, action, env_id=None):
        self.send(action, np.arange(self.num_envs) if env_id is None else env_id)
        return self.recv()

    def close(self):
        self.pool.close()


def setup(args, policy, params, key, margin: int = 0):
    """--self-play's (pool of past parameters, for run.open; a function that returns an actor's
    envs' {"opponents": ...}: each actor thread has its own, told the version it acts with);
    without it (None, a function that returns {}). `policy`: the script's jitted policy step, which
    the latest and past opponents play (sampling), with draws of their own (`key` folded);
    `margin`: the snapshots kept for an actor that lags behind the learner."""
    if not args.self_play:
        return None, dict
    size, interval = args.opponent_pool_size, args.opponent_snapshot_interval
    pool = Pool(params, interval, size, margin, args.seed)
    key = jax.random.fold_in(key, 0xFFFFFFFF)  # not an actor's: those fold in their index

    def opponents():
        return {"opponents": Opponents(policy, key, args.opponent_mix, pool, seed=args.seed)}

    return pool, opponents


def turns(envs, env_ids):
    """1 where the observation of `env_ids` is the learner's move (SeatPool), else 0; 1.0 for a
    one-player pool."""
    seats = getattr(envs, "turns", None)
    return 1.0 if seats is None else seats[env_ids]


def acting(envs, version: int, params):
    """Tell the opponents of `envs` (a SeatPool's, or SplitPools' shared ones) the parameters that
    act now, and their version (which past snapshot plays is a function of it)."""
    opponents = getattr(envs, "opponents", None)
    if opponents is not None:
        opponents.acting(version, params)


def outcomes(envs) -> list:
    """The (opponent kind, learner's place, reward) of the games that ended since the last call
    (every SeatPool of `envs`); [] for one-player pools."""
    pools = getattr(envs, "pools", [envs])
    games = [game for pool in pools for game in getattr(pool, "outcomes", ())]
    for pool in pools:
        if hasattr(pool, "outcomes"):
            pool.outcomes = []
    return games


class Opponents:
    """Who plays the seats that are not the learner's. Each game draws its opponents' kind from
    `mix` (fractions of games: latest, past, random); `policy` (the script's jitted policy step)
    plays the latest parameters and a past snapshot (`pool.past`, by the acting version; `fixed`:
    always those parameters, an evaluation's), with the draws of `key`."""

    def __init__(self, policy, key, mix, pool=None, fixed=None, seed: int = 0):
        self.policy, self.key = policy, key
        self.pool, self.seed = pool, seed
        self.bounds = np.cumsum(mix)[:-1]
        self.params = {"past": fixed} if fixed is not None else {}
        self.past_version = None

    def draw(self, keys, games):
        """The kinds (indices of KINDS) of the games `games` of envs keyed `keys`."""
        return np.searchsorted(self.bounds, uniform(self.seed + 1, keys, games), side="right")

    def acting(self, version: int, params):
        self.params["latest"] = params
        if self.pool is None:
            return
        past, snapshot = self.pool.past(version)
        if past != self.past_version:
            device = next(iter(jax.tree.leaves(params)[0].devices()))
            self.params["past"] = jax.device_put(snapshot, device)
            self.past_version = past

    def act(self, kind: str, obs, keys, steps):
        action = self.policy(self.params[kind], obs, None, self.key, keys, steps)[0]
        return np.asarray(action)


class Pool:
    """Past parameters: a snapshot every `interval` updates (version 0 included), the newest `size`
    of them the past opponents drawn from, and `margin` older ones kept for actors that act with
    an older version than the learner's (the asynchronous script's lag)."""

    def __init__(self, params, interval: int, size: int, margin: int = 0, seed: int = 0):
        self.interval, self.size, self.seed = interval, size, seed
        self.slots = size + margin
        self.template = jax.tree.map(np.asarray, jax.device_get(params))
        self.snapshots = {}  # version -> host params
        self.lock = threading.Lock()

    def add(self, version: int, params):
        """The learner's parameters after update `version`: kept if it is a snapshot's."""
        if version % self.interval:
            return
        params = jax.tree.map(np.asarray, jax.device_get(params))
        with self.lock:
            self.snapshots[version] = params
            for old in sorted(self.snapshots)[: -self.slots]:
                del self.snapshots[old]

    def past(self, version: int):
        """(version, parameters) of the snapshot that plays the past opponent while `version`
        acts: one of the newest `size` at that version (the current one's own included), drawn by
        the version; the oldest kept if that one is not (an actor that lags further, a resume
        with another interval)."""
        newest = version // self.interval
        choices = np.arange(max(0, newest - self.size + 1), newest + 1) * self.interval
        pick = int(choices[int(uniform(self.seed + 2, version, 0) * len(choices))])
        with self.lock:
            pick = pick if pick in self.snapshots else min(self.snapshots)
            return pick, self.snapshots[pick]

    def state(self) -> dict:
        """{"opponents": the newest `size` snapshots stacked [size, ...] and their versions (-1:
        empty)}: a structure fixed by --opponent-pool-size, as a checkpoint restores into a
        template (the margin is not kept: a resumed run's actors act from its version on)."""
        with self.lock:
            versions = sorted(self.snapshots)[-self.size :]
            stacked = [self.snapshots[v] for v in versions]
        stacked += [self.template] * (self.size - len(stacked))
        params = jax.tree.map(lambda *x: np.stack(x), *stacked)
        kept = np.full(self.size, -1, np.int64)
        kept[: len(versions)] = versions
        return {"opponents": {"versions": kept, "params": params}}

    def load(self, state: dict):
        """Take the snapshots out of a restored state (see `state`)."""
        stored = state.pop("opponents", None)
        if stored is None:
            return
        versions = np.asarray(stored["versions"])
        if versions.dtype.kind not in "iu" or versions.ndim != 1:
            raise UsageError(
                f"--resume: its opponent pool's versions are {versions.dtype} {versions.shape}"
            )
        with self.lock:
            self.snapshots = {
                int(v): jax.tree.map(lambda x, i=i: np.asarray(x[i]), stored["params"])
                for i, v in enumerate(versions)
                if v >= 0
            }


def decisions(rollout: dict) -> dict:
    """A rollout of env steps [T, B] made into one of the learner's decisions, env by env: its
    rows where it moved (`valid`) last, in their order, the other rows first with `valid` 0; a
    decision's reward is the sum of its seat's rewards from its move until its next one, cut at
    the game's end (the loss the opponent's winning move delivers included), and its `dones` 1 if
    the game ended meanwhile (a truncated game ends too: these games have no time limit). So GAE and
    V-trace, unchanged, link each decision to the next. An env's last move whose game goes on past
    the rollout is not a row but the bootstrap (`bootstrap_obs`: a state where the learner moves,
    as the value is trained on), and the rewards of its move are not counted: one move an env a
    rollout. Returns the rollout's time-major arrays and `bootstrap_obs`, rearranged."""
    mine = rollout["valid"] > 0
    T, B = mine.shape
    rewards, dones = np.zeros((T, B), np.float32), np.zeros((T, B), np.float32)
    pending, ended = np.zeros(B, np.float32), np.zeros(B, bool)
    for t in reversed(range(T)):
        cut = rollout["dones"][t] > 0
        pending = np.where(cut, 0.0, pending) + rollout["rewards"][t]
        ended = cut | ended
        rewards[t], dones[t] = np.where(mine[t], pending, 0.0), mine[t] & ended
        pending, ended = np.where(mine[t], 0.0, pending), ended & ~mine[t]
    last = T - 1 - np.argmax(mine[::-1], axis=0)  # each env's last move (if it has one)
    open_ = mine[last, np.arange(B)] & (dones[last, np.arange(B)] == 0)
    envs = np.flatnonzero(open_)
    mine[last[envs], envs] = False
    rewards[last[envs], envs] = 0.0
    bootstrap = jax.tree.map(np.copy, rollout["bootstrap_obs"])
    for leaf, rows in zip(jax.tree.leaves(bootstrap), jax.tree.leaves(rollout["obs"])):
        leaf[envs] = rows[last[envs], envs]
    order = np.argsort(mine, axis=0, kind="stable")  # [T, B]: non-decisions, then decisions

    def rearrange(x):
        return np.take_along_axis(x, order.reshape(T, B, *[1] * (x.ndim - 2)), axis=0)

    out = {k: rollout[k] for k in TIME_MAJOR if rollout.get(k) is not None}
    out.update(rewards=rewards, dones=dones, truncated=np.zeros((T, B), np.float32))
    out["valid"] = mine.astype(np.float32)
    out = {k: jax.tree.map(rearrange, x) for k, x in out.items()}
    return dict(out, bootstrap_obs=bootstrap)


class WinRates:
    """The outcomes of the last `window` training games against each kind of opponent, logged as
    selfplay/win_rate_vs_<kind> (and _draw_rate_): the sampling policy's, at no extra cost."""

    def __init__(self, window: int = 100):
        self.games = {kind: collections.deque(maxlen=window) for kind in KINDS}

    def add(self, outcomes) -> dict:
        """Add (kind, place, reward) outcomes; return the scalars of the kinds that have games."""
        for kind, _, reward in outcomes:
            self.games[kind].append(reward)
        scalars = {}
        for kind, rewards in self.games.items():
            if rewards:
                scalars[f"selfplay/win_rate_vs_{kind}"] = float(np.mean(np.array(rewards) > 0))
                scalars[f"selfplay/draw_rate_vs_{kind}"] = float(np.mean(np.array(rewards) == 0))
        return scalars


def summary(outcomes, players: int) -> str:
    """Wins, draws and losses by the learner's place in the turn order (first mover: place 0)."""
    parts = []
    for place in range(players):
        rewards = np.array([r for _, p, r in outcomes if p == place])
        if len(rewards):
            wins, draws = int((rewards > 0).sum()), int((rewards == 0).sum())
            losses = len(rewards) - wins - draws
            parts.append(f"moving {ordinal(place)}: {wins} won, {draws} drawn, {losses} lost")
    return "; ".join(parts)


def ordinal(place: int) -> str:
    return {0: "first", 1: "second", 2: "third"}.get(place, f"{place + 1}th")
