"""Tasks: making an envpool, reading its spaces, which tasks are served and which preset
a task takes, how the network encodes each observation leaf, and the game scores.

Observations are pytrees: a `Box` space is one array, a `Dict` space a dict of arrays (nested
as envpool returns it); everything here maps over that tree.
"""

import difflib
import functools
import importlib
import json
import os
import sys
import traceback

import envpool
import gymnasium
import jax
import numpy as np

from jax_async_rl import gym_pool, selfplay
from jax_async_rl.flags import UsageError

# envpool's module of a task (envpool.mujoco.dmc, ...) -> the PRESETS family it takes.
FAMILIES = {
    "atari": "atari",
    "mujoco.dmc": "dm_control",
    "minigrid": "minigrid",
    "highway": "highway",
    "gfootball": "gfootball",
    "vizdoom": "vizdoom",
}
# the observation leaf of the legal actions (Jumanji's tasks; a user's env's Dict)
MASK = "action_mask"
# VizDoom's buttons as one Discrete action: envpool's default is a float Box over [DBL_MIN,
# DBL_MAX].
VIZDOOM = dict(use_combined_action=True)
# A user's Gymnasium envs (--env-id module:callable, or --env-module): env id -> its maker, and
# the seconds it may take to answer (--env-timeout).
USER_ENVS, ENV_TIMEOUTS = {}, {}
BUILT_IN = set(gymnasium.registry)  # Gymnasium's own ids, to name what a user's module added
# The stop event of the run in this process (runs.Run sets it): a user env's training pool stops
# waiting on it (evaluation's, after training has stopped, does not).
RUN_STOP = [None]


def register_user_env(args):
    """Make a user's env known by its --env-id (user_maker's checks; an envpool id: nothing)."""
    maker = user_maker(
        args.env_id, getattr(args, "env_module", None), getattr(args, "env_kwargs", "")
    )
    if maker is not None:
        USER_ENVS[args.env_id] = maker
        ENV_TIMEOUTS[args.env_id] = getattr(args, "env_timeout", 300.0)
        spaces.cache_clear()
        policy_space.cache_clear()


def user_maker(env_id: str, env_module, env_kwargs: str):
    """The maker (picklable) of a user's env, checked by making one; None for an envpool task.
    UsageError, one line, for a module that does not import, a name or id it does not have,
    keyword arguments that are not a JSON object or that the env does not take."""
    if ":" not in env_id and not env_module:
        if env_kwargs:
            raise UsageError(
                "--env-kwargs is for a Gymnasium env (--env-id module:callable, or --env-module)"
            )
        return None
    try:
        kwargs = json.loads(env_kwargs) if env_kwargs else {}
    except ValueError as e:
        raise UsageError(f"--env-kwargs {env_kwargs!r} is not JSON ({e})")
    if not isinstance(kwargs, dict):
        raise UsageError(
            f'--env-kwargs {env_kwargs!r} is not a JSON object ({{"name": value, ...}})'
        )
    if os.getcwd() not in sys.path:
        # the working directory's modules, as `python -m` finds them
        sys.path.insert(0, os.getcwd())
    module = env_module or env_id.split(":", 1)[0]
    try:
        importlib.import_module(module)
    except Exception as e:
        raise UsageError(
            f"--env-{'module' if env_module else 'id'} {module}: cannot import it "
            f"({type(e).__name__}: {e})"
        )
    if not env_module and not hasattr(sys.modules[module], env_id.split(":", 1)[1]):
        raise UsageError(f"--env-id {env_id}: {module} has no {env_id.split(':', 1)[1]!r}")
    if env_module and env_id not in gymnasium.registry:
        raise UsageError(
            f"--env-id {env_id} is not registered by {env_module} (it registers "
            f"{', '.join(sorted(set(gymnasium.registry) - BUILT_IN)) or 'nothing'})"
        )
    make = functools.partial(gym_pool.make_user_env, env_id, env_module, kwargs)
    try:
        env = make()
    except TypeError as e:
        raise UsageError(f"--env-kwargs {env_kwargs or '{}'}: {env_id} does not take them ({e})")
    except Exception as e:
        raise UsageError(f"--env-id {env_id}: making it raised {raised(e)}")
    if not isinstance(env, gymnasium.Env):
        raise UsageError(f"--env-id {env_id} made a {type(env).__name__}, not a gymnasium.Env")
    try:
        obs = env.reset(seed=0)[0]
    except Exception as e:
        raise UsageError(f"--env-id {env_id}: its first reset() raised {raised(e)}")
    finally:
        env.close()
    check_observation(env_id, env.observation_space, obs, "observation")
    return make


def raised(error: Exception) -> str:
    """An exception of a user's env in one line: its type, message and the line that raised it."""
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return f"{type(error).__name__}: {error} ({frame.filename}, line {frame.lineno})"


def check_observation(env_id: str, space, obs, where: str):
    """UsageError naming the field of a reset's observation that its space does not describe."""
    if isinstance(space, gymnasium.spaces.Dict):
        if not isinstance(obs, dict) or set(obs) != set(space.spaces):
            raise UsageError(
                f"--env-id {env_id}: reset() returned {where} keys "
                f"{sorted(obs) if isinstance(obs, dict) else type(obs).__name__}"
                f" where observation_space has {sorted(space.spaces)}"
            )
        for key, sub in space.spaces.items():
            check_observation(env_id, sub, obs[key], f"{where}[{key!r}]")
        return
    shape = np.shape(obs)
    if shape != tuple(space.shape or ()):
        raise UsageError(
            f"--env-id {env_id}: reset() returned {where} of shape {shape} where observation_space "
            f"says {tuple(space.shape or ())}"
        )


def env_kind(env_id: str) -> str:
    """A task's family, from the envpool module that registers it: 'atari', 'dm_control',
    'minigrid' (and BabyAI), 'highway', 'gfootball', 'vizdoom', 'mujoco' (Gym MuJoCo, MetaWorld,
    MyoSuite, Gymnasium-Robotics, MuJoCo Playground), 'pgx' (its board games and poker of several
    players; its one-player 2048 is 'classic') or 'classic' (any other: classic control, Box2D,
    ...)."""
    if env_id in USER_ENVS:
        return "gym"
    family = envpool.registration.registry.specs[env_id][0].removeprefix("envpool.")
    if family == "pgx" and players(env_id) > 1:  # board games and poker (--self-play)
        return "pgx"
    return FAMILIES.get(family, "mujoco" if family.startswith("mujoco") else "classic")


@functools.lru_cache(maxsize=None)
def spaces(env_id: str):
    """(observation space, action space) of a task, gymnasium's, from its spec without starting
    it."""
    if env_id in USER_ENVS:
        env = USER_ENVS[env_id]()
        env.close()
        return env.observation_space, env.action_space
    spec = envpool.make_spec(env_id, **(VIZDOOM if env_kind(env_id) == "vizdoom" else {}))
    if hasattr(spec, "gymnasium_observation_space"):
        found = spec.gymnasium_observation_space, spec.gymnasium_action_space
    else:
        found = spec.observation_space, spec.action_space
    # a multi-player game: as --self-play's learner sees it, from its seat
    return selfplay.seat_spaces(*found) if players(env_id) > 1 else found


@functools.lru_cache(maxsize=None)
def players(env_id: str) -> int:
    """The number of players of an envpool task (1 for a user's env)."""
    return 1 if env_id in USER_ENVS else int(envpool.make_spec(env_id).config.max_num_players)


def space_tree(space):
    """The observation pytree's structure with spaces as leaves: a Dict space becomes a dict (nested
    as envpool returns it), any other space is one leaf."""
    if type(space).__name__ == "Dict":
        return {key: space_tree(value) for key, value in space.spaces.items()}
    return space


def zeros_like_space(space, *batch):
    """An observation of zeros with leading dimensions `batch` (templates, network init)."""
    return jax.tree.map(lambda s: np.zeros((*batch, *s.shape), s.dtype), space_tree(space))


def check_task(env_id: str, self_play: bool = False):
    """The observation space of a task these scripts can train on; else UsageError, one line
    (an unknown id gets the nearest known ones). A multi-player game needs `self_play`, and takes
    it only if its players take turns (selfplay.check_game)."""
    known = envpool.list_all_envs()
    if env_id in USER_ENVS:
        return check_spaces(env_id, *spaces(env_id))
    if env_id not in known:
        close = difflib.get_close_matches(env_id, known, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see envpool.list_all_envs()"
        raise UsageError(f"--env-id {env_id!r} is not an envpool task{hint}")
    try:
        spec = envpool.make_spec(env_id)
        obs_space, action_space = spaces(env_id)
    # e.g. Procgen without the system Qt 5 runtime: envpool's line gives the install command
    except Exception as e:
        raise UsageError(
            f"--env-id {env_id} cannot be made here: {(str(e) or type(e).__name__).splitlines()[0]}"
        )
    count = spec.config.max_num_players
    if count > 1 and not self_play:
        raise UsageError(
            f"--env-id {env_id} is a {count}-player game: train it with --self-play "
            "(ppo_sync_baseline.py, appo_envpool.py, impala_envpool.py)"
        )
    if count == 1 and self_play:
        raise UsageError(f"--self-play: --env-id {env_id} is a one-player task")
    if count > 1:
        env = envpool.make(env_id, env_type="gymnasium", num_envs=1, seed=0)
        problem = selfplay.check_game(env_id, count, env.reset()[1])
        env.close()
        if problem:
            raise UsageError(problem)
    return check_spaces(env_id, obs_space, action_space)


def check_spaces(env_id: str, obs_space, action_space):
    """The observation space, if these scripts can train on its and the action space's kinds (and
    its mask fits)."""
    kind = type(action_space).__name__
    if kind not in ("Discrete", "Box", "MultiDiscrete"):
        raise UsageError(
            f"--env-id {env_id} has {kind} actions; these scripts take Discrete, continuous "
            f"(float Box) "
            "and multi-discrete (integer Box, MultiDiscrete) actions"
        )
    shape, nvec = mask_shape(obs_space), choices(action_space)[1]
    # joint, one row a dimension
    fits = [] if nvec is None else [tuple(nvec.tolist()), (len(nvec), int(nvec.max()))]
    fits = [(int(action_space.n),)] if kind == "Discrete" else fits
    if shape is not None and fits and shape not in fits:
        raise UsageError(
            f"--env-id {env_id}: its observation's {MASK!r} {shape} is no mask of its "
            f"{action_space} actions "
            f"(shapes that are: {' or '.join(map(str, fits))}); rename the leaf if it is "
            f"something else"
        )
    # bool, int, uint
    if shape is not None and fits and space_tree(obs_space)[MASK].dtype.kind not in "biu":
        raise UsageError(
            f"--env-id {env_id}: its {MASK!r} {space_tree(obs_space)[MASK]} is not of bools or "
            f"ints "
            "(a mask's); rename the leaf if it is something else"
        )
    for leaf in jax.tree.leaves(space_tree(obs_space)):
        if type(leaf).__name__ not in ("Box", "Discrete", "MultiBinary"):
            raise UsageError(
                f"--env-id {env_id} has {type(leaf).__name__} observations; these scripts take "
                f"Box, "
                "Discrete and MultiBinary observations and Dicts of them"
            )
    return obs_space


def preset_name(env_id: str, presets: dict) -> str:
    """The `presets` entry of a task: its own (CartPole-v1 -> "CartPole"), else its family's,
    else classic."""
    name, kind = env_id.rsplit("-v", 1)[0], env_kind(env_id)
    return name if name in presets else kind if kind in presets else "classic"


def preset_values(args, presets: dict) -> dict:
    """The values of a task's preset (`preset_name`) for the flags of `args` left at None, once
    the task is checked (`check_task`; a user's env is made known first: register_user_env)."""
    register_user_env(args)
    check_task(args.env_id, getattr(args, "self_play", False))
    preset = presets[preset_name(args.env_id, presets)]
    return {k: v for k, v in preset.items() if getattr(args, k) is None}


def make_env(env_id: str, num_envs: int, seed: int, num_threads: int, train: bool, **kwargs):
    """An envpool of `num_envs` environments (gymnasium API, auto-reset).

    For training, Atari games end an episode at each life lost and clip rewards to [-1, 1]
    (Mnih et al. 2015); the game score stays available in info["reward"] / info["terminated"].
    """
    # a user's Gymnasium env, in worker processes behind envpool's interface
    if env_id in USER_ENVS:
        extra = {"render_mode": kwargs["render_mode"]} if "render_mode" in kwargs else {}
        maker = functools.partial(USER_ENVS[env_id], **extra) if extra else USER_ENVS[env_id]
        return gym_pool.GymPool(
            maker,
            num_envs,
            kwargs.get("batch_size", num_envs),
            seed,
            num_threads or os.cpu_count() or 1,
            ENV_TIMEOUTS.get(env_id, 300.0),
            RUN_STOP[0] if train else None,
        )
    kind, opponents = env_kind(env_id), kwargs.pop("opponents", None)
    kwargs.update(
        dict(episodic_life=train, reward_clip=train, noop_max=30) if kind == "atari" else {}
    )
    kwargs.update(VIZDOOM if kind == "vizdoom" else {})
    num_threads = num_threads or min(os.cpu_count() or 1, num_envs)
    # envpool 1.2.5's pgx games draw their chance (the first mover, dice, cards) from a generator
    # that its threads share: with more than one, a game depends on their timing. One thread
    # keeps --deterministic runs reproducible; these games step in microseconds.
    num_threads = 1 if kind == "pgx" else num_threads
    pool = envpool.make(
        env_id,
        env_type="gymnasium",
        num_envs=num_envs,
        seed=seed,
        num_threads=num_threads,
        **kwargs,
    )
    if players(env_id) == 1:
        return pool
    # a multi-player game (--self-play): the learner's seat; `opponents` play the others
    return selfplay.SeatPool(pool, num_envs, players(env_id), seed, opponents)


def mask_shape(obs_space):
    """The shape of one observation's legal actions, its Dict's "action_mask" leaf (Jumanji's, or a
    user's env's); None without one."""
    tree = space_tree(obs_space)
    return tuple(tree[MASK].shape) if isinstance(tree, dict) and MASK in tree else None


def check_legal(args, obs, env_ids, acting, steps, when: str = "of its episode"):
    """With --action-mask, gym_pool.EnvError (the actor's: exit 1, a checkpoint) naming the first
    env whose "action_mask" holds values other than 0 and 1, or none legal (a factored mask: in a
    dimension) where an action is taken (`acting`: not an episode's last observation), and its step
    (`steps`, counted `when`)."""
    if not getattr(args, "action_mask", False) or not isinstance(obs, dict) or MASK not in obs:
        return
    rows = np.asarray(obs[MASK]).reshape(
        len(env_ids), len(getattr(policy_space(args.env_id), "nvec", [0])), -1
    )
    odd = ((rows != 0) & (rows != 1)).any(axis=(1, 2))
    wrong = odd | np.asarray(acting) & ~rows.any(axis=2).all(axis=1)
    if wrong.any():
        i = int(np.flatnonzero(wrong)[0])
        what = (
            f"values other than 0 and 1 ({np.unique(rows[i]).tolist()})"
            if odd[i]
            else "no legal action"
        )
        raise gym_pool.EnvError(
            f"env {int(env_ids[i])}'s {MASK!r} has {what} at step {int(steps[i])} {when}"
        )


def choices(action_space):
    """(the lowest value [D], the number of choices [D]) of each dimension of integer (Box or
    MultiDiscrete) actions, flattened; (None, None) for Discrete and continuous actions."""
    if type(action_space).__name__ == "MultiDiscrete":
        return np.ravel(action_space.start), np.ravel(action_space.nvec)
    if hasattr(action_space, "n") or np.issubdtype(action_space.dtype, np.floating):
        return None, None
    low = np.ravel(action_space.low).astype(np.int64)
    return low, np.ravel(action_space.high).astype(np.int64) - low + 1


@functools.lru_cache(maxsize=None)
def policy_space(env_id: str):
    """The actions a policy samples for a task: Discrete and continuous actions as the env's. D
    integer dimensions of n_1, ..., n_D choices (an integer Box, MultiDiscrete): where the
    observation's "action_mask" is joint, of shape (n_1, ..., n_D) (Minesweeper, Tetris, BinPack),
    Discrete(n_1 x ... x n_D), one categorical over their product, whose index env_action unravels
    (row-major); else MultiDiscrete(n_1, ..., n_D), a factored policy: one categorical a dimension,
    with a mask of one row per dimension, (D, max n_d) (Connector, Cleaner, RobotWarehouse), or
    none. Continuous actions of several axes are flattened."""
    obs_space, action_space = spaces(env_id)
    nvec = choices(action_space)[1]
    # continuous, flattened (SearchAndRescue's [2, 2])
    if nvec is None and len(getattr(action_space, "shape", ())) > 1:
        return gymnasium.spaces.Box(
            action_space.low.ravel(), action_space.high.ravel(), dtype=action_space.dtype
        )
    if nvec is None:
        return action_space
    if mask_shape(obs_space) == tuple(nvec):
        return gymnasium.spaces.Discrete(int(np.prod(nvec)))
    return gymnasium.spaces.MultiDiscrete(nvec)


def make_actor_env(
    env_id: str,
    num_envs: int,
    seed: int,
    num_threads: int,
    num_splits: int,
    deterministic: bool,
    opponents=None,
):
    """An actor thread's training envs in `num_splits` splits (double buffering, Sample Factory
    §3.2): one envpool whose `recv` returns whichever split is stepped first, or with
    `deterministic` a SplitPools, whose splits come in turn. `opponents`: --self-play's."""
    if not deterministic:
        return make_env(
            env_id,
            num_envs,
            seed,
            num_threads,
            train=True,
            batch_size=num_envs // num_splits,
            **({"opponents": opponents} if opponents else {}),
        )
    split, threads = (
        num_envs // num_splits,
        max(1, (num_threads or os.cpu_count() or 1) // num_splits),
    )
    extra = {"opponents": opponents} if opponents else {}
    return SplitPools(
        [
            make_env(env_id, split, seed + i * split, threads, train=True, **extra)
            for i in range(num_splits)
        ],
        split,
    )


class SplitPools:
    """Envs in splits of their own pools (env j of pool i is env i x split + j, seeded as in one
    pool), stepped in turn: `recv` waits for pool 0's whole batch, then pool 1's, ..., so which
    envs share a batch, their order in it and the order of batches never depend on timing, while
    the other pools step (double buffering). envpool's interface otherwise (`send`: one pool's
    envs)."""

    def __init__(self, pools: list, split: int):
        self.pools, self.turn, self.split = pools, 0, split
        self.action_space, self.observation_space = (
            pools[0].action_space,
            pools[0].observation_space,
        )

        self.opponents = getattr(pools[0], "opponents", None)  # --self-play's, shared

    @property
    def turns(self):
        """--self-play (SeatPools): 1 where the learner is to move, by env (selfplay.turns)."""
        if not hasattr(self.pools[0], "turns"):
            return None
        return np.concatenate([pool.turns for pool in self.pools])

    def async_reset(self):
        for pool in self.pools:
            pool.async_reset()

    def recv(self):
        obs, reward, terminated, truncated, info = self.pools[self.turn].recv()
        order = np.argsort(info["env_id"])  # a pool's own order, not timing's
        info = {
            k: v[order] if isinstance(v, np.ndarray) and v.shape[:1] == order.shape else v
            for k, v in info.items()
        }
        info["env_id"] = info["env_id"] + self.turn * self.split
        self.turn = (self.turn + 1) % len(self.pools)
        return (
            jax.tree.map(lambda x: x[order], obs),
            reward[order],
            terminated[order],
            truncated[order],
            info,
        )

    def send(self, action, env_ids):
        pool = int(env_ids[0]) // self.split
        self.pools[pool].send(action, env_ids - pool * self.split)

    def close(self):
        for pool in self.pools:
            pool.close()


def env_action(action, action_space):
    """The env's action for the policy's `action` [B, ...] (numpy, or jax inside a jitted call;
    see policy_space): Gaussian actions in the env's shape, clipped to the action bounds; integer
    ones in the env's shape and dtype from their lowest value on, a joint categorical's index [B]
    first unravelled (row-major) into one choice per dimension; Discrete ones as they are."""
    if hasattr(action_space, "n"):
        return action
    low, nvec = choices(action_space)
    if nvec is None:
        return action.reshape(len(action), *action_space.shape).clip(
            action_space.low, action_space.high
        )
    if action.ndim == 1:  # an index over the product of the choices
        action = action[:, None] // np.append(np.cumprod(nvec[::-1])[::-1][1:], 1) % nvec
    return (
        action.reshape(len(action), *action_space.shape) + low.reshape(action_space.shape)
    ).astype(action_space.dtype)


def leaf_encoder(space) -> tuple:
    """How the network encodes one observation leaf, read from its space (no per-family tables).

    A rank-3 uint8 Box is an image. Its channels are the smaller of its first and last axes:
    Atari and VizDoom stack frames first, [C, H, W]; CarRacing, gfootball, MiniGrid and Procgen
    are [H, W, C] (a tie reads channels-last); either way the conv sees [B, H, W, C]. Images of at
    least 36x36 take the Nature CNN on pixels / 255 ("nature"); smaller grids, the MiniGrid
    literature's small conv on their raw symbolic codes ("grid"; from 7x7 up). A Discrete leaf is
    one-hot ("onehot", (n, start)). Anything else (float or integer Boxes of any rank, MultiBinary,
    smaller grids) is flattened to floats, uint8 scaled by 1/255 ("flat", scale).
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


class EpisodeStats:
    """Game scores per environment: unclipped rewards over the whole game (all lives)."""

    def __init__(self, num_envs: int):
        self.returns = np.zeros(num_envs, np.float64)
        self.finished = []  # (env, return, length) of games that ended since the last `pop`

    def update(self, env_ids, rewards, terminated, truncated, info):
        """Add one step of envs `env_ids`; a game ends at info["terminated"] (Atari) or term|trunc.
        gym_pool.EnvError for a NaN or inf reward: the env's fault, named before a loss is."""
        raw = info.get("reward", rewards)
        if not np.isfinite(raw).all():
            i = int(np.flatnonzero(~np.isfinite(raw))[0])
            raise gym_pool.EnvError(
                f"env {int(env_ids[i])} returned a non-finite reward ({raw[i]}) at step "
                f"{int(info['elapsed_step'][i])} of its episode"
            )
        self.returns[env_ids] += raw
        game_over = info.get("terminated", terminated) | truncated
        for i in np.flatnonzero(game_over):
            env = env_ids[i]
            self.finished.append((int(env), float(self.returns[env]), int(info["elapsed_step"][i])))
            self.returns[env] = 0.0

    def pop(self):
        finished, self.finished = self.finished, []
        return finished
