"""jax_async_rl.checkpoints: a checkpoint's round trip, atomic writes, every way a file can fail
to be one (one line each), resuming with the run's own flags, importing a training script, and
which script and task a run folder belongs to."""

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Annotated, Optional

import flax.serialization
import jax
import numpy as np
import optax
import pytest

from jax_async_rl import checkpoints, flags
from jax_async_rl.checkpoints import CHECKPOINT
from jax_async_rl.flags import PRESET, UsageError
from jax_async_rl.normalize import Normalizer


@dataclass
class ToyArgs(flags.RunArgs):
    """A toy script's flags: one of each kind resume treats differently."""

    gamma: float = 0.99
    num_envs: int = 8
    norm_obs: Annotated[Optional[bool], PRESET] = None
    norm_reward: Annotated[Optional[bool], PRESET] = None
    lstm: bool = False


def small_state():
    """A state like a script's: params, Adam state after one step (non-zero moments), counters."""
    rng = np.random.default_rng(0)
    params = {
        "params": {
            "Dense_0": {
                "kernel": rng.normal(size=(4, 3)).astype(np.float32),
                "bias": rng.normal(size=3).astype(np.float32),
            },
            "log_std": rng.normal(size=2).astype(np.float32),
        }
    }
    optimizer = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-3))
    opt_state = optimizer.init(params)
    _, opt_state = optimizer.update(
        jax.tree.map(lambda x: np.full_like(x, 0.3), params), opt_state, params
    )
    return {"params": params, "opt_state": opt_state, "global_step": 12_345, "policy_version": 67}


def saved(tmp_path, script="toy_script.py", **flags_):
    """A checkpoint of a toy run (HalfCheetah-v4, normalised) at tmp_path/run/; its path."""
    state, normalizer = small_state(), Normalizer(np.zeros(3), 2, True, True, 0.99)
    normalizer.observe(np.arange(12, dtype=np.float64).reshape(4, 3))
    args = ToyArgs(env_id="HalfCheetah-v4", norm_obs=True, norm_reward=True, **flags_)
    (tmp_path / "run").mkdir(exist_ok=True)
    path = tmp_path / "run" / CHECKPOINT
    checkpoints.save_checkpoint(str(path), state, args, normalizer, f"/somewhere/{script}")
    return path, state, normalizer


def test_a_checkpoint_round_trip_restores_every_leaf_and_leaves_no_temporary_file(tmp_path):
    path, state, normalizer = saved(tmp_path)
    assert [p.name for p in path.parent.iterdir()] == [CHECKPOINT], "temporary file left behind"
    payload = checkpoints.read_checkpoint(str(path))
    assert payload["config"]["env_id"] == "HalfCheetah-v4" and payload["script"] == "toy_script.py"
    assert payload["script_path"] == "/somewhere/toy_script.py"
    fresh = Normalizer(np.zeros(3), 2, True, True, 0.99)
    template = jax.tree.map(np.zeros_like, dict(state, **fresh.state()))
    restored = checkpoints.load_checkpoint(payload, template, str(path))
    fresh.load(restored)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for want, got in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(fresh.obs_stats[0], normalizer.obs_stats[0])
    other = jax.tree.map(np.zeros_like, dict(state, **fresh.state()))
    other["params"]["params"]["Dense_0"]["kernel"] = np.zeros((5, 3), np.float32)
    with pytest.raises(UsageError, match="other shapes"):
        checkpoints.load_checkpoint(payload, other, str(path))


def test_the_stored_config_names_no_run_folder_so_identical_runs_write_identical_files(tmp_path):
    """--run-dir and --resume say where this launch wrote and what it continued, not what it
    trained: two runs alike in all else write the same bytes, and resume reads the file."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = saved(tmp_path / "a", run_dir=str(tmp_path / "a" / "run"))[0].read_bytes()
    two, _, _ = saved(tmp_path / "b", run_dir=str(tmp_path / "b" / "run"), resume="elsewhere/run")
    assert two.read_bytes() == one
    assert not {"run_dir", "resume"} & set(checkpoints.read_checkpoint(str(two))["config"])
    args = checkpoints.resume_args(
        ToyArgs(resume=str(two.parent), run_dir="kept"), set(), "toy_script.py"
    )[0]
    assert (
        args.env_id == "HalfCheetah-v4"
        and args.resume == str(two.parent)
        and args.run_dir == "kept"
    )


def test_a_resumed_state_compiles_nothing_that_a_fresh_one_did_not(tmp_path):
    """A fresh state's counters are Python ints, which JAX types weakly, and an update keeps them
    weak; the checkpoint stores them as numpy int32. Restored as stored, the update jitted on the
    fresh state compiled again for the resumed one (and missed the persistent compile cache: 45 s
    on Pong)."""
    normalizer = Normalizer(np.zeros(3), 2, True, True, 0.99)
    fresh = dict(small_state(), policy_version=0)
    update = jax.jit(lambda s: dict(s, policy_version=s["policy_version"] + 1))
    compiles = []
    with jax.log_compiles(), LogRecords(compiles, "Compiling"):
        state = update(jax.device_put(fresh))
        path = str(tmp_path / CHECKPOINT)
        checkpoints.save_checkpoint(
            path, state, ToyArgs(env_id="HalfCheetah-v4"), normalizer, "toy_script.py"
        )
        template = dict(fresh, **normalizer.state())
        restored = checkpoints.load_checkpoint(checkpoints.read_checkpoint(path), template, path)
        jax.block_until_ready(update(jax.device_put({k: restored[k] for k in fresh})))
    assert len(compiles) == 1, compiles


class LogRecords(logging.Handler):
    """The log messages that contain `text`, collected while the block runs (jax's loggers)."""

    def __init__(self, into: list, text: str):
        super().__init__()
        self.into, self.text = into, text

    def emit(self, record):
        if self.text in record.getMessage():
            self.into.append(record.getMessage()[:200])

    def __enter__(self):
        logging.getLogger("jax").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("jax").removeHandler(self)


def test_a_crash_during_a_write_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "file"
    checkpoints.write_atomically(str(path), b"good")

    def crash(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        checkpoints.write_atomically(str(path), b"half-written")
    assert path.read_bytes() == b"good"


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda d: None, "no checkpoint at"),
        (
            lambda d: (d / CHECKPOINT).write_bytes(np.random.default_rng(0).bytes(4096)),
            "not a readable checkpoint",
        ),
        (lambda d: (d / CHECKPOINT).write_bytes(b""), "not a readable checkpoint"),
        (
            lambda d: (d / CHECKPOINT).write_bytes(
                flax.serialization.msgpack_serialize({"weights": np.zeros(3)})
            ),
            "no 'state'",
        ),
        (
            lambda d: (d / CHECKPOINT).write_bytes(
                flax.serialization.msgpack_serialize(
                    {"state": {}, "config": "{}", "script": "../evil.py"}
                )
            ),
            "not a script's file name",
        ),
        (
            lambda d: (d / CHECKPOINT).write_bytes(
                flax.serialization.msgpack_serialize(
                    {"state": {}, "config": "[1, 2]", "script": "a.py"}
                )
            ),
            "no readable config",
        ),
    ],
)
def test_what_is_not_a_checkpoint_is_one_line(tmp_path, make, fragment):
    make(tmp_path)
    with pytest.raises(UsageError) as error:
        checkpoints.read_checkpoint(checkpoints.checkpoint_path(str(tmp_path)))
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_a_truncated_checkpoint_is_one_line(tmp_path):
    path, _, _ = saved(tmp_path)
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(UsageError, match="corrupt or truncated"):
        checkpoints.read_checkpoint(str(path))


def test_resume_takes_the_runs_flags_and_those_given_replace_them(tmp_path):
    path, _, _ = saved(tmp_path, gamma=0.9, num_envs=4)
    script = "/elsewhere/toy_script.py"
    resumed, payload, changed = checkpoints.resume_args(
        ToyArgs(resume=str(path.parent), num_envs=16), {"num_envs"}, script
    )
    assert (resumed.env_id, resumed.gamma, resumed.num_envs, resumed.norm_obs) == (
        "HalfCheetah-v4",
        0.9,
        16,
        True,
    )
    assert changed == {"num_envs": 16} and payload["state"]["global_step"] == 12_345
    # A flag given as None (its preset) keeps the run's value: no way around a fixed flag.
    resumed, _, changed = checkpoints.resume_args(
        ToyArgs(resume=str(path), norm_reward=None), {"norm_reward"}, script
    )
    assert resumed.norm_reward is True and not changed
    # Without `given`, the flags that differ from the defaults count as given (in-process callers).
    resumed, _, changed = checkpoints.resume_args(
        ToyArgs(resume=str(path), total_timesteps=99), None, script
    )
    assert changed == {"total_timesteps": 99}
    # The launch flags are never restored: the devices and processes are this machine's.
    resumed, _, _ = checkpoints.resume_args(
        ToyArgs(resume=str(path), learner_device_ids=[0, 1]), set(), script
    )
    assert resumed.learner_device_ids == [0, 1]


@pytest.mark.parametrize("change", [dict(env_id="Ant-v4"), dict(norm_obs=False), dict(lstm=True)])
def test_resume_refuses_a_flag_that_cannot_change_mid_run(tmp_path, change):
    path, _, _ = saved(tmp_path)
    with pytest.raises(
        UsageError, match=f"--{next(iter(change)).replace('_', '-')} cannot change mid-run"
    ):
        checkpoints.resume_args(ToyArgs(resume=str(path), **change), set(change), "toy_script.py")


def test_resume_refuses_another_scripts_checkpoint(tmp_path):
    path, _, _ = saved(tmp_path, script="impala_envpool.py")
    with pytest.raises(UsageError, match="written by impala_envpool.py, not appo_envpool.py"):
        checkpoints.resume_args(ToyArgs(resume=str(path)), set(), "appo_envpool.py")
    with pytest.raises(UsageError, match="--resume: no checkpoint at"):
        checkpoints.resume_args(ToyArgs(resume=str(tmp_path / "nothing")), set(), "appo_envpool.py")


def test_load_script_imports_a_file_once_and_names_one_that_does_not_import(tmp_path):
    good = tmp_path / "my_script.py"
    good.write_text("VALUE = 42\n")
    module = checkpoints.load_script(good)
    assert module.VALUE == 42 and checkpoints.load_script(good) is module
    bad = tmp_path / "broken_script.py"
    bad.write_text("import no_such_module_anywhere\n")
    with pytest.raises(UsageError, match="cannot be imported .*ModuleNotFoundError"):
        checkpoints.load_script(bad)


def test_run_identity_reads_config_json_else_the_checkpoint(tmp_path):
    path, _, _ = saved(tmp_path)
    assert checkpoints.run_identity(str(path.parent)) == {
        "script": "toy_script",
        "env_id": "HalfCheetah-v4",
        "seed": 1,
    }
    (path.parent / "config.json").write_text(
        json.dumps(dict(dataclasses.asdict(ToyArgs(env_id="Pong-v5")), exp_name="mine"))
    )
    assert checkpoints.run_identity(str(path.parent))["script"] == "mine"
    (path.parent / "config.json").write_text("not json")
    with pytest.raises(UsageError, match="is not a run's config"):
        checkpoints.run_identity(str(path.parent))
    with pytest.raises(UsageError, match="neither config.json nor checkpoint.msgpack"):
        checkpoints.run_identity(str(tmp_path))
