"""Tasks: making an envpool, reading its spaces, which tasks are served and which preset
a task takes, how the network encodes each observation leaf, and the game scores.

Observations are pytrees: a `Box` space is one array, a `Dict` space a dict of arrays (nested
as envpool returns it); everything here maps over that tree.
"""

import difflib
import functools
import os

import envpool
import gymnasium
import jax
import numpy as np

from jax_async_rl import gym_pool
from jax_async_rl.flags import UsageError

# envpool's module of a task (envpool.mujoco.dmc, ...) -> the PRESETS family it takes.
FAMILIES = {"atari": "atari", "mujoco.dmc": "dm_control", "minigrid": "minigrid", "highway": "highway", "gfootball": "gfootball",
            "vizdoom": "vizdoom"}
MASK = "action_mask"  # the observation leaf of the legal actions (Jumanji's tasks; a user's env's Dict)
# VizDoom's buttons as one Discrete action: envpool's default is a float Box over [DBL_MIN, DBL_MAX].
VIZDOOM = dict(use_combined_action=True)
# A user's Gymnasium envs (--env-id module:callable, or --env-module): env id -> its maker.
USER_ENVS = {}


def register_user_env(args):
    """Make a user's env known by its --env-id (gym_pool.user_maker's checks; an envpool id: nothing)."""
    maker = gym_pool.user_maker(args.env_id, getattr(args, "env_module", None), getattr(args, "env_kwargs", ""))
    if maker is not None:
        USER_ENVS[args.env_id] = maker
        spaces.cache_clear()
        policy_space.cache_clear()


def env_kind(env_id: str) -> str:
    """A task's family, from the envpool module that registers it: 'atari', 'dm_control',
    'minigrid' (and BabyAI), 'highway', 'gfootball', 'vizdoom', 'mujoco' (Gym MuJoCo, MetaWorld, MyoSuite,
    Gymnasium-Robotics, MuJoCo Playground) or 'classic' (any other: classic control, Box2D, ...)."""
    if env_id in USER_ENVS:
        return "gym"
    family = envpool.registration.registry.specs[env_id][0].removeprefix("envpool.")
    return FAMILIES.get(family, "mujoco" if family.startswith("mujoco") else "classic")


@functools.lru_cache(maxsize=None)
def spaces(env_id: str):
    """(observation space, action space) of a task, gymnasium's, from its spec without starting it."""
    if env_id in USER_ENVS:
        env = USER_ENVS[env_id]()
        env.close()
        return env.observation_space, env.action_space
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


def check_task(env_id: str):
    """The observation space of a task these scripts can train on; else UsageError, one line
    (an unknown id gets the nearest known ones)."""
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
    except Exception as e:  # e.g. Procgen without the system Qt 5 runtime: envpool's line gives the install command
        raise UsageError(f"--env-id {env_id} cannot be made here: {(str(e) or type(e).__name__).splitlines()[0]}")
    if spec.config.max_num_players > 1:
        raise UsageError(f"--env-id {env_id} is a {spec.config.max_num_players}-player task; these scripts train one agent")
    return check_spaces(env_id, obs_space, action_space)


def check_spaces(env_id: str, obs_space, action_space):
    """The observation space, if these scripts can train on its and the action space's kinds (and
    its "action_mask" leaf, if any, is a mask of these actions: see policy_space)."""
    kind = type(action_space).__name__
    if kind not in ("Discrete", "Box", "MultiDiscrete"):
        raise UsageError(f"--env-id {env_id} has {kind} actions; these scripts take Discrete, continuous (float Box) "
                         "and multi-discrete (integer Box, MultiDiscrete) actions")
    shape, nvec = mask_shape(obs_space), choices(action_space)[1]
    fits = [] if nvec is None else [tuple(nvec.tolist()), (len(nvec), int(nvec.max()))]  # joint, one row a dimension
    fits = [(int(action_space.n),)] if kind == "Discrete" else fits
    if shape is not None and fits and shape not in fits:
        raise UsageError(f"--env-id {env_id}: its observation's {MASK!r} {shape} is no mask of its {action_space} actions "
                         f"(shapes that are: {' or '.join(map(str, fits))}); rename the leaf if it is something else")
    for leaf in jax.tree.leaves(space_tree(obs_space)):
        if type(leaf).__name__ not in ("Box", "Discrete", "MultiBinary"):
            raise UsageError(f"--env-id {env_id} has {type(leaf).__name__} observations; these scripts take Box, "
                             "Discrete and MultiBinary observations and Dicts of them")
    return obs_space


def preset_name(env_id: str, presets: dict) -> str:
    """The `presets` entry of a task: its own (CartPole-v1 -> "CartPole"), else its family's, else classic."""
    name, kind = env_id.rsplit("-v", 1)[0], env_kind(env_id)
    return name if name in presets else kind if kind in presets else "classic"


def preset_values(args, presets: dict) -> dict:
    """The values of a task's preset (`preset_name`) for the flags of `args` left at None, once
    the task is checked (`check_task`; a user's env is made known first: register_user_env)."""
    register_user_env(args)
    check_task(args.env_id)
    preset = presets[preset_name(args.env_id, presets)]
    return {k: v for k, v in preset.items() if getattr(args, k) is None}


def make_env(env_id: str, num_envs: int, seed: int, num_threads: int, train: bool, **kwargs):
    """An envpool of `num_envs` environments (gymnasium API, auto-reset).

    For training, Atari games end an episode at each life lost and clip rewards to [-1, 1]
    (Mnih et al. 2015); the game score stays available in info["reward"] / info["terminated"].
    """
    if env_id in USER_ENVS:  # a user's Gymnasium env, in worker processes behind envpool's interface
        extra = {"render_mode": kwargs["render_mode"]} if "render_mode" in kwargs else {}
        maker = functools.partial(USER_ENVS[env_id], **extra) if extra else USER_ENVS[env_id]
        return gym_pool.GymPool(maker, num_envs, kwargs.get("batch_size", num_envs), seed, num_threads or os.cpu_count() or 1)
    kind = env_kind(env_id)
    kwargs.update(dict(episodic_life=train, reward_clip=train, noop_max=30) if kind == "atari" else {})
    kwargs.update(VIZDOOM if kind == "vizdoom" else {})
    num_threads = num_threads or min(os.cpu_count() or 1, num_envs)
    return envpool.make(
        env_id, env_type="gymnasium", num_envs=num_envs, seed=seed, num_threads=num_threads, **kwargs
    )


def mask_shape(obs_space):
    """The shape of one observation's legal actions, its Dict's "action_mask" leaf (Jumanji's, or a
    user's env's); None without one."""
    tree = space_tree(obs_space)
    return tuple(tree[MASK].shape) if isinstance(tree, dict) and MASK in tree else None


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
    with a mask of one row per dimension, (D, max n_d) (Connector, Cleaner, RobotWarehouse), or none.
    Continuous actions of several axes are flattened."""
    obs_space, action_space = spaces(env_id)
    nvec = choices(action_space)[1]
    if nvec is None and len(getattr(action_space, "shape", ())) > 1:  # continuous, flattened (SearchAndRescue's [2, 2])
        return gymnasium.spaces.Box(action_space.low.ravel(), action_space.high.ravel(), dtype=action_space.dtype)
    if nvec is None:
        return action_space
    if mask_shape(obs_space) == tuple(nvec):
        return gymnasium.spaces.Discrete(int(np.prod(nvec)))
    return gymnasium.spaces.MultiDiscrete(nvec)


def env_action(action, action_space):
    """The env's action for the policy's `action` [B, ...] (numpy, or jax inside a jitted call;
    see policy_space): Gaussian actions in the env's shape, clipped to the action bounds; integer
    ones in the env's shape and dtype from their lowest value on, a joint categorical's index [B]
    first unravelled (row-major) into one choice per dimension; Discrete ones as they are."""
    if hasattr(action_space, "n"):
        return action
    low, nvec = choices(action_space)
    if nvec is None:
        return action.reshape(len(action), *action_space.shape).clip(action_space.low, action_space.high)
    if action.ndim == 1:  # an index over the product of the choices
        action = action[:, None] // np.append(np.cumprod(nvec[::-1])[::-1][1:], 1) % nvec
    return (action.reshape(len(action), *action_space.shape) + low.reshape(action_space.shape)).astype(action_space.dtype)


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
