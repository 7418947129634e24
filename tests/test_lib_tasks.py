"""jax_async_rl.tasks: which tasks are served (one line for the rest), their family and preset,
the spaces and the observations envpool returns, the encoder of each leaf, the game scores."""

import types

import envpool
import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_async_rl import gym_pool, tasks
from jax_async_rl.flags import UsageError


def box(shape, dtype=np.float32, high=1.0):
    return gymnasium.spaces.Box(0, high, shape, dtype)


def test_leaf_encoder_reads_the_space():
    assert tasks.leaf_encoder(box((4, 84, 84), np.uint8, 255)) == ("nature", "chw")  # Atari
    assert tasks.leaf_encoder(box((12, 84, 84), np.uint8, 255)) == ("nature", "chw")  # VizDoom
    assert tasks.leaf_encoder(box((96, 96, 3), np.uint8, 255)) == ("nature", "hwc")  # CarRacing
    assert tasks.leaf_encoder(box((72, 96, 4), np.uint8, 255)) == ("nature", "hwc")  # gfootball
    assert tasks.leaf_encoder(box((7, 7, 3), np.uint8, 255)) == ("grid", "hwc")  # MiniGrid
    assert tasks.leaf_encoder(box((5, 5, 3), np.uint8, 255)) == (
        "flat",
        1 / 255,
    )  # too small for the grid conv
    assert tasks.leaf_encoder(box((96,), np.uint8, 255)) == (
        "flat",
        1 / 255,
    )  # MiniGrid's mission bytes
    assert tasks.leaf_encoder(box((5, 5))) == ("flat", 1.0)  # highway's kinematics: flattened
    assert tasks.leaf_encoder(box((8, 8, 119))) == ("flat", 1.0)  # float planes are not pixels
    assert tasks.leaf_encoder(gymnasium.spaces.Discrete(500)) == ("onehot", (500, 0))
    assert tasks.leaf_encoder(gymnasium.spaces.Discrete(21, start=-1)) == (
        "onehot",
        (21, -1),
    )  # Jumanji TSP's position
    assert tasks.leaf_encoder(gymnasium.spaces.MultiBinary((9, 9, 17))) == ("flat", 1.0)


def test_encoders_follow_the_order_of_the_observation_leaves():
    space = gymnasium.spaces.Dict(
        {"b": gymnasium.spaces.Discrete(3), "a": box((7, 7, 3), np.uint8, 255)}
    )
    leaves = jax.tree.leaves(tasks.zeros_like_space(space, 2))
    assert [x.shape for x in leaves] == [(2, 7, 7, 3), (2,)]  # jax sorts dict keys
    assert tasks.encoders(space) == (("grid", "hwc"), ("onehot", (3, 0)))


@pytest.mark.parametrize(
    "env_id", ["MiniGrid-Empty-5x5-v0", "Maze-v0", "CheetahRun-v1", "FetchReach-v1", "Taxi-v3"]
)
def test_observations_envpool_returns_match_the_space(env_id):
    """The network and the buffers are built from the space; what envpool returns must have the
    same tree (keys, nesting, order) and leaf shapes, after reset and after a step."""
    obs_space, _ = tasks.spaces(env_id)
    template = tasks.zeros_like_space(obs_space, 2)
    envs = tasks.make_env(env_id, 2, 0, 1, train=True)
    try:
        obs, _ = envs.reset()
        for _ in range(2):
            assert jax.tree.structure(obs) == jax.tree.structure(template), env_id
            assert [np.shape(x) for x in jax.tree.leaves(obs)] == [
                x.shape for x in jax.tree.leaves(template)
            ]
            action = np.zeros((2, *envs.action_space.shape), envs.action_space.dtype)
            obs = envs.step(action)[0]
    finally:
        envs.close()


PRESETS = {
    "classic": {},
    "CartPole": {},
    "mujoco": {},
    "atari": {},
    "dm_control": {},
    "minigrid": {},
    "pgx": {},
    "TicTacToe": {},
}


@pytest.mark.parametrize(
    ("env_id", "kind", "preset"),
    [
        ("Pong-v5", "atari", "atari"),
        ("CartPole-v1", "classic", "CartPole"),
        ("Acrobot-v1", "classic", "classic"),
        ("HalfCheetah-v4", "mujoco", "mujoco"),
        ("MetaWorld/Reach-v3", "mujoco", "mujoco"),
        ("FetchReach-v1", "mujoco", "mujoco"),
        ("CheetahRun-v1", "dm_control", "dm_control"),
        ("BabyAI-GoToRedBallGrey-v0", "minigrid", "minigrid"),
        ("Highway-v0", "highway", "classic"),
        ("Taxi-v3", "classic", "classic"),
        ("ConnectFour-v1", "pgx", "pgx"),  # pgx's games of several players (--self-play)
        ("TicTacToe-v1", "pgx", "TicTacToe"),  # and the one with a preset of its own
        ("Play2048-v1", "classic", "classic"),  # and its one-player game
    ],
)
def test_a_task_takes_its_own_preset_else_its_familys_else_classic(env_id, kind, preset):
    assert tasks.env_kind(env_id) == kind
    assert tasks.preset_name(env_id, PRESETS) == preset


NOT_SERVED = [
    ("IntersectionMultiAgent-v0", ["2-player game", "--self-play"]),
    ("Go9x9-v1", ["2-player game", "--self-play"]),
    ("VizdoomCustom-v1", ["cannot be made here"]),
    ("CartPol-v1", ["is not an envpool task", "did you mean", "CartPole-v1"]),
]
try:
    envpool.make_spec("BigfishEasy-v0")
except ImportError:  # Procgen without the system Qt 5 runtime: the install command
    NOT_SERVED.append(("BigfishEasy-v0", ["cannot be made here", "Qt 5", "apt install"]))


@pytest.mark.parametrize(("env_id", "fragments"), NOT_SERVED)
def test_what_is_not_served_is_one_line(env_id, fragments):
    with pytest.raises(UsageError) as error:
        tasks.check_task(env_id)
    message = str(error.value)
    assert "\n" not in message and "--env-id" in message and env_id in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_preset_values_fill_only_what_is_left_out():

    class Args:
        env_id, steps, rate = "CartPole-v1", None, 0.1

    assert tasks.preset_values(Args(), {"classic": {}, "CartPole": dict(steps=32, rate=1e-3)}) == {
        "steps": 32
    }


def test_spaces_that_are_not_served_are_one_line():
    """A user's env with actions of another kind, or an "action_mask" that is no mask of its
    actions."""
    obs = gymnasium.spaces.Dict({"x": box((3,)), "action_mask": gymnasium.spaces.MultiBinary(5)})
    for actions, fragments in [
        (
            gymnasium.spaces.Tuple([gymnasium.spaces.Discrete(2)] * 2),
            ["Tuple actions", "multi-discrete"],
        ),
        (
            gymnasium.spaces.Discrete(4),
            ["'action_mask' (5,) is no mask", "Discrete(4)", "(4,)", "rename"],
        ),
        (gymnasium.spaces.MultiDiscrete([3, 4]), ["(5,) is no mask", "(3, 4) or (2, 4)"]),
    ]:
        with pytest.raises(UsageError) as error:
            tasks.check_spaces("my_env:Env", obs, actions)
        assert "\n" not in str(error.value) and "--env-id my_env:Env" in str(error.value), str(
            error.value
        )
        for fragment in fragments:
            assert fragment in str(error.value), (fragment, str(error.value))


# Jumanji's multi-discrete tasks, read from their spaces here: the mask is joint (the product of the
# choices), one row a dimension, or absent.
POLICY_SPACES = [
    ("Minesweeper-v0", (10, 10), gymnasium.spaces.Discrete(100)),
    ("Tetris-v0", (4, 10), gymnasium.spaces.Discrete(40)),
    ("BinPack-v2", (40, 20), gymnasium.spaces.Discrete(800)),
    ("Connector-v2", (10, 5), gymnasium.spaces.MultiDiscrete([5] * 10)),
    ("RobotWarehouse-v0", (4, 5), gymnasium.spaces.MultiDiscrete([5] * 4)),
    ("RubiksCube-v0", None, gymnasium.spaces.MultiDiscrete([6, 1, 3])),
    ("Game2048-v1", (4,), gymnasium.spaces.Discrete(4)),
    ("CartPole-v1", None, gymnasium.spaces.Discrete(2)),
]


@pytest.mark.parametrize(("env_id", "mask", "space"), POLICY_SPACES)
def test_the_policy_samples_one_categorical_over_a_joint_mask_else_one_a_dimension(
    env_id, mask, space
):
    obs_space, action_space = tasks.spaces(env_id)
    assert tasks.mask_shape(obs_space) == mask
    assert tasks.policy_space(env_id) == space
    assert tasks.check_task(env_id) is obs_space  # served
    if hasattr(space, "nvec") or space.n != getattr(action_space, "n", None):
        assert tasks.choices(action_space)[1].tolist() == (
            list(space.nvec) if hasattr(space, "nvec") else list(mask)
        )


def test_integer_actions_reach_the_env_in_its_shape_and_dtype():
    """A joint categorical's index is the row-major position in the mask (np.unravel_index): the
    action the env gets is the cell that the mask's entry at that index is about."""
    space = gymnasium.spaces.Box(
        np.array([0, 2]), np.array([3, 4]), (2,), np.int32
    )  # 4 x 3 choices, from [0, 2]
    index = np.arange(12)
    got = tasks.env_action(index, space)
    assert got.dtype == np.int32 and got.shape == (12, 2)
    np.testing.assert_array_equal(got, np.stack(np.unravel_index(index, (4, 3)), -1) + [0, 2])
    np.testing.assert_array_equal(
        np.asarray(tasks.env_action(jnp.asarray(index), space)), got
    )  # inside a jitted call
    factored = np.array(
        [[3, 0], [1, 2]]
    )  # one choice a dimension, counted from each one's lowest value
    np.testing.assert_array_equal(tasks.env_action(factored, space), [[3, 2], [1, 4]])
    multi = gymnasium.spaces.MultiDiscrete([3, 2], start=[-1, 5])
    assert tasks.env_action(np.array([[2, 1]]), multi).tolist() == [[1, 6]]
    assert tasks.env_action(np.array([5]), multi).tolist() == [[1, 6]]  # 5 = 2 x 2 + 1


def test_gaussian_actions_are_clipped_to_the_bounds_and_discrete_ones_pass():
    space = gymnasium.spaces.Box(-1.0, 2.0, (2,), np.float32)
    np.testing.assert_array_equal(tasks.env_action(np.array([[-3.0, 5.0]]), space), [[-1.0, 2.0]])
    # Several axes (Jumanji's SearchAndRescue: [2, 2]): the policy samples them flattened.
    assert tasks.policy_space("SearchAndRescue-v0") == gymnasium.spaces.Box(
        -1.0, 1.0, (4,), np.float32
    )
    square = gymnasium.spaces.Box(np.array([[-1.0, 0.0], [0.0, 0.0]]), 1.0, (2, 2), np.float32)
    np.testing.assert_array_equal(
        tasks.env_action(np.array([[-3.0, -3.0, 0.5, 3.0]]), square), [[[-1, 0], [0.5, 1]]]
    )
    action = np.array([3, 1])
    assert tasks.env_action(action, gymnasium.spaces.Discrete(4)) is action


def test_episode_stats_count_the_game_score_over_all_lives():
    """Atari ends training episodes at each life lost (terminated) but the game at
    info['terminated']: the score is the raw reward (info['reward']) over the whole game, its length
    the game's steps."""
    stats = tasks.EpisodeStats(2)
    ids = np.array([0, 1])
    life_lost = dict(
        reward=np.array([1.0, 2.0]),
        terminated=np.array([False, False]),
        elapsed_step=np.array([5, 5]),
    )
    stats.update(
        ids, np.array([1.0, 1.0]), np.array([True, False]), np.array([False, False]), life_lost
    )
    assert stats.pop() == []
    game_over = dict(
        reward=np.array([-1.0, 4.0]),
        terminated=np.array([True, False]),
        elapsed_step=np.array([9, 9]),
    )
    stats.update(
        ids, np.array([-1.0, 1.0]), np.array([True, False]), np.array([False, True]), game_over
    )
    assert stats.pop() == [(0, 0.0, 9), (1, 6.0, 9)]  # env 1: truncated, also a game's end
    stats.update(
        ids[:1],
        np.array([3.0]),
        np.array([False]),
        np.array([False]),
        {"elapsed_step": np.array([1])},
    )
    assert stats.returns[0] == 3.0 and stats.returns[1] == 0.0  # reset after each game


def test_a_non_finite_reward_is_the_envs_fault_named_where_it_enters():
    """Every actor's rewards pass EpisodeStats: a NaN or an inf is refused there, naming the env
    and its step, before the learner turns it into a non-finite loss."""
    stats = tasks.EpisodeStats(3)
    stats.update(
        np.arange(3),
        np.ones(3),
        np.zeros(3, bool),
        np.zeros(3, bool),
        {"elapsed_step": np.ones(3, int)},
    )
    with pytest.raises(
        gym_pool.EnvError,
        match=r"^env 2 returned a non-finite reward \(-inf\) at step 4 of its episode$",
    ):
        stats.update(
            np.array([1, 2]),
            np.array([0.5, -np.inf]),
            np.zeros(2, bool),
            np.zeros(2, bool),
            {"elapsed_step": np.array([4, 4])},
        )


def test_check_legal_names_the_env_and_step_of_a_mask_that_cannot_be_obeyed():
    """No legal action where an action is to be taken, or a value other than 0 and 1: EnvError
    naming the env and its step; none legal on an episode's last observation (Jumanji's games end
    so; the env ignores that action) passes; a factored mask needs a legal action in each row."""
    ids, steps, empty = np.array([4, 5, 6]), np.array([10, 11, 12]), np.zeros((3, 10, 10), np.int8)

    def masked(env_id, action_mask=True):  # a script's args
        return types.SimpleNamespace(env_id=env_id, action_mask=action_mask)

    tasks.check_legal(
        masked("Minesweeper-v0"), {"action_mask": empty}, ids, np.zeros(3, bool), steps
    )
    with pytest.raises(
        gym_pool.EnvError,
        match="env 5's 'action_mask' has no legal action at step 11 of its episode",
    ):
        tasks.check_legal(
            masked("Minesweeper-v0"),
            {"action_mask": empty},
            ids,
            np.array([False, True, False]),
            steps,
        )
    tasks.check_legal(
        masked("Minesweeper-v0", False), {"action_mask": empty}, ids, np.ones(3, bool), steps
    )  # an input
    odd = np.ones((3, 10, 10), np.int8)
    odd[0, 3, 3] = -1
    with pytest.raises(
        gym_pool.EnvError,
        match=r"env 4's 'action_mask' has values other than 0 and 1 \(\[-1, 1\]\)",
    ):
        tasks.check_legal(
            masked("Minesweeper-v0"),
            {"action_mask": odd},
            ids,
            np.zeros(3, bool),
            steps,
            "of the run",
        )
    factored = np.ones((3, 10, 5), np.int8)  # Connector-v2: 10 agents, 5 moves each
    factored[2, 7] = 0
    with pytest.raises(
        gym_pool.EnvError, match="env 6's 'action_mask' has no legal action at step 12"
    ):
        tasks.check_legal(
            masked("Connector-v2"), {"action_mask": factored}, ids, np.ones(3, bool), steps
        )
    tasks.check_legal(
        masked("Connector-v2"),
        {"action_mask": factored[:2] > 0},
        ids[:2],
        np.ones(2, bool),
        steps[:2],
    )
    tasks.check_legal(
        masked("CartPole-v1"), np.zeros((3, 4), np.float32), ids, np.ones(3, bool), steps
    )  # no mask
