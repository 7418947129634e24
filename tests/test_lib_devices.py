"""jax_async_rl.devices in one process on one device: the batch in words, the device flags'
checks, the env axis of a rollout's leaves, the lockstep agreement's one-process case, the keys.
(Many devices and processes: tests/test_scale.py, in subprocesses.)"""

from dataclasses import dataclass, field

import jax
import numpy as np
import pytest

from jax_async_rl import devices
from jax_async_rl.flags import UsageError


@dataclass
class Sync:
    num_envs: int = 8
    num_steps: int = 32
    actor_device_ids: list = field(default_factory=lambda: [0])
    learner_device_ids: list = field(default_factory=lambda: [0])


@dataclass
class Async(Sync):
    num_actor_threads: int = 2


def test_the_batch_in_words_names_actor_threads_only_where_a_script_has_them():
    assert devices.describe_batch(Sync()) == "1 process x 8 envs x 32 steps = 256 env steps"
    assert (
        devices.describe_batch(Async())
        == "1 process x 2 actor threads x 8 envs x 32 steps = 512 env steps"
    )
    assert devices.local_envs(Async(num_envs=4)) == devices.global_envs(Async(num_envs=4)) == 8


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (Sync(actor_device_ids=[1]), ["--actor-device-ids 1", "1 cpu devices"]),
        (Sync(learner_device_ids=[0, 0]), ["--learner-device-ids 0 0", "at most once"]),
        (Sync(actor_device_ids=[]), ["--actor-device-ids"]),
    ],
)
def test_device_ids_this_process_lacks_are_one_line(args, fragments):
    with pytest.raises(UsageError) as error:
        devices.make_mesh(args)
    for fragment in fragments:
        assert fragment in str(error.value)


def test_one_device_is_the_actor_and_a_mesh_of_one_learner():
    actors, mesh = devices.make_mesh(Sync())
    assert (
        actors == [jax.local_devices()[0]]
        and mesh.devices.shape == (1,)
        and mesh.axis_names == ("env",)
    )
    rollout = {
        "obs": np.zeros((4, 8, 3)),
        "bootstrap_obs": np.zeros((8, 3)),
        "state": (np.zeros((8, 2)),),
    }
    # One learner device in one process: the host arrays go into the jitted update's call as they
    # are (no device_put of their own: 5x cheaper for a replay round's small batches).
    assert devices.to_learner(mesh, rollout) is rollout
    assert devices.to_actor(None, rollout) is rollout


def test_the_env_axis_of_each_leaf():
    paths = jax.tree_util.tree_flatten_with_path(
        {"obs": 0, "bootstrap_obs": 0, "state": (0, 0), "rewards": 0}
    )[0]
    assert {jax.tree_util.keystr(p): devices.env_axis(p) for p, _ in paths} == {
        "['bootstrap_obs']": 0,
        "['obs']": 1,
        "['rewards']": 1,
        "['state'][0]": 0,
        "['state'][1]": 0,
    }


def test_agree_in_one_process_stops_on_a_signal_or_a_stop_and_keeps_its_games():
    games = [(0, 1.0, 10)]
    assert devices.agree([], False, games) == (False, games)
    assert devices.agree([], True, games)[0] and devices.agree([15], False, [])[0]
    assert devices.agree_on_flags(Sync(), None) is None  # nothing to compare with


def test_actor_keys_differ_and_actor_0_keeps_the_run_key():
    key = jax.random.PRNGKey(3)
    assert (devices.actor_key(key, 0) == key).all()
    assert not (devices.actor_key(key, 1) == devices.actor_key(key, 2)).all()
