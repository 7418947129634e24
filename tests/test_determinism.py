"""--deterministic: asynchronous runs that reproduce bit for bit from their seed. The keys and
streams that make an env's draws its own; SplitPools, which hand out the splits in turn; each
script run twice with one seed (identical checkpoints, identical metrics but for wall time, SPS
and timing/*); APPO at --actor-lag 0 against the sync baseline (the same parameters, bit for
bit); the same on 4 devices; 2 processes as 1 process of 2 devices; the flags it refuses."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (
    SCRIPT_TABLE,
    TINY_BATCH,
    assert_usage_error,
    count_complete_lines,
    load_script,
    read_checkpoint,
    run_main,
    run_script,
    sigterm_when,
    tiny_flags,
)
from jax_async_rl import keys, tasks
from test_scale import finish_processes, start_processes

# ---------------------------------------------------------------------------------------------
# Keys, streams, splits
# ---------------------------------------------------------------------------------------------


def test_env_keys_are_one_per_env_and_step_the_same_in_numpy_and_jax():
    env_ids, steps = np.repeat(np.arange(300), 300), np.tile(np.arange(300), 300)
    key = np.asarray(jax.random.PRNGKey(5))
    host = keys.env_keys(key, env_ids, steps, np)
    assert host.dtype == np.uint32 and host.shape == (90_000, 2)
    assert len({tuple(k) for k in host.tolist()}) == 90_000  # distinct for every (env, step)
    np.testing.assert_array_equal(
        jax.jit(lambda e, s: keys.env_keys(key, e, s, jnp))(env_ids, steps), host
    )
    other = keys.env_keys(np.asarray(jax.random.PRNGKey(6)), env_ids, steps, np)
    assert not (other == host).all(axis=1).any()  # another run's key: none shared
    # A key is a function of its row alone: a batch's other rows do not change it.
    np.testing.assert_array_equal(keys.env_keys(key, env_ids[7:9], steps[7:9], np), host[7:9])


def test_env_streams_draw_the_same_whatever_batches_the_envs_come_in():
    """Env e's draw at step t is the same stepped alone, in a full batch, or in shuffled halves,
    also past a block's end; another seed's stream differs."""
    full, halves, other = (
        keys.EnvStreams(3, 8, 8, 2),
        keys.EnvStreams(3, 8, 8, 2),
        keys.EnvStreams(4, 8, 8, 2),
    )
    rng, draws = np.random.default_rng(0), {}
    for t in range(2 * keys.BLOCK + 5):
        batch = full.uniform(np.arange(8, 16), np.full(8, t))
        for half in rng.permutation([np.arange(8, 12), np.arange(12, 16)]):
            ids = rng.permutation(half)
            for e, u in zip(ids, halves.uniform(ids, np.full(4, t))):
                draws[int(e), t] = u
        for e in range(8, 16):
            np.testing.assert_array_equal(batch[e - 8], draws[e, t])
    assert not np.array_equal(
        other.uniform(np.arange(8, 16), np.zeros(8, int)),
        full.uniform(np.arange(8, 16), np.zeros(8, int)),
    )


def test_split_pools_hand_out_the_splits_in_turn_as_one_pool_would_step_them():
    """tasks.SplitPools of 3 CartPole pools of 2 envs: recv returns pool 0's envs, then 1's, then
    2's, each whole and in env order, with global env ids; stepped with the actions one pool of 6
    envs takes, every observation is that pool's."""
    pools = tasks.make_actor_env("CartPole-v1", 6, 11, 1, 3, deterministic=True)
    whole = tasks.make_env("CartPole-v1", 6, 11, 1, train=True)
    expected = whole.reset()[0]
    pools.async_reset()
    rng = np.random.default_rng(0)
    for t in range(40):
        got = np.zeros_like(expected)
        for split in range(3):
            obs, _, _, _, info = pools.recv()
            np.testing.assert_array_equal(info["env_id"], [2 * split, 2 * split + 1])
            got[info["env_id"]] = obs
        np.testing.assert_array_equal(got, expected, err_msg=f"step {t}")
        actions = rng.integers(0, 2, 6)
        for split in range(3):
            pools.send(actions[2 * split : 2 * split + 2], np.arange(2 * split, 2 * split + 2))
        expected = whole.step(actions)[0]
    pools.close()
    whole.close()


# ---------------------------------------------------------------------------------------------
# Two runs, one seed
# ---------------------------------------------------------------------------------------------

TINY_REPLAY = dict(
    num_envs=4,
    num_steps=8,
    total_timesteps=768,
    learning_starts=128,
    batch_size=32,
    buffer_size=1000,
    eval_episodes=0,
    log_frequency=1,
)
RUNS = {
    "appo": ("appo_envpool.py", {}),
    "appo-2-splits": ("appo_envpool.py", dict(num_splits=2)),
    "appo-lstm": ("appo_envpool.py", dict(lstm=True, num_splits=2)),
    "appo-2-actor-threads": ("appo_envpool.py", dict(num_actor_threads=2, num_splits=2)),
    "appo-norm-obs": ("appo_envpool.py", dict(norm_obs=True, norm_reward=True, num_splits=2)),
    # Two actor threads take turns on the normaliser (normalize.InTurn): 16 updates, 16 turns each.
    "appo-2-actor-threads-norm": (
        "appo_envpool.py",
        dict(
            num_actor_threads=2,
            num_splits=2,
            norm_obs=True,
            norm_reward=True,
            total_timesteps=16 * 2 * TINY_BATCH,
        ),
    ),
    "impala": ("impala_envpool.py", dict(num_splits=2)),  # --deterministic alone: --actor-lag 1
    "xla-actor": ("appo_envpool_xla.py", dict(num_splits=1)),
    "appo-masked-factored": (
        "appo_envpool.py",
        dict(env_id="Cleaner-v0", num_splits=2),
    ),  # a mask row a dimension
    "dqn": (
        "dqn_envpool.py",
        dict(TINY_REPLAY, actor_lag=1, num_splits=2, prioritized_replay=True, n_step=3),
    ),
    "dqn-masked": (
        "dqn_envpool.py",
        dict(TINY_REPLAY, env_id="Minesweeper-v0", actor_lag=1, num_splits=2, replay_ratio=1),
    ),
    # R2D2: 2 gradient steps a round on 8 sequences of 2 burn-in + 4 learned steps, the states the
    # actor held.
    "dqn-lstm": (
        "dqn_envpool.py",
        dict(
            TINY_REPLAY,
            actor_lag=1,
            num_splits=2,
            lstm=True,
            lstm_size=16,
            seq_len=4,
            burn_in=2,
            seq_period=2,
            n_step=2,
            batch_size=8,
            replay_ratio=3.0,
        ),
    ),
    "sac": ("sac_envpool.py", dict(TINY_REPLAY, env_id="Pendulum-v1", num_splits=2)),  # as IMPALA's
    "td3": ("td3_envpool.py", dict(TINY_REPLAY, env_id="Pendulum-v1", actor_lag=1)),
}


def flags_of(script, **flags) -> list:
    """The command line of `flags` (a bool: a switch, or a preset's value)."""
    module = load_script(script)
    out = []
    for name, value in flags.items():
        if isinstance(value, bool) and getattr(module.Args, name, None) is not None:
            out.append(f"--{name.replace('_', '-')}" if value else f"--no-{name.replace('_', '-')}")
        else:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def records(run_dir) -> list:
    """metrics.jsonl but wall time, SPS and timing/*: what a run computes, not how fast."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        (r["step"], r["tag"], r["value"])
        for r in lines
        if r["tag"] != "charts/SPS" and not r["tag"].startswith("timing/")
    ]


def assert_identical(a, b):
    left, right = (
        jax.tree.leaves(read_checkpoint(a)["state"]),
        jax.tree.leaves(read_checkpoint(b)["state"]),
    )
    assert len(left) == len(right)
    assert all(np.array_equal(x, y) for x, y in zip(left, right)), "the checkpoints differ"
    ra, rb = records(a), records(b)
    assert ra == rb, (
        next((x, y) for x, y in zip(ra, rb) if x != y) if len(ra) == len(rb) else (len(ra), len(rb))
    )
    assert ra


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(RUNS))
def test_two_runs_with_one_seed_are_identical(name, tmp_path, capsys, monkeypatch):
    """... and writes the same checkpoint file, and the run asks XLA for its deterministic GPU
    kernels (read when the backend starts)."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    script, own = RUNS[name]
    tiny = tiny_flags(script) if script in SCRIPT_TABLE else {}
    flags = {**tiny, "env_id": "CartPole-v1", **own, "deterministic": True, "seed": 3}
    for i in (0, 1):
        code, _, err = run_main(
            script, [*flags_of(script, **flags), "--run-dir", tmp_path / str(i)], capsys
        )
        assert code == 0, err
    assert_identical(tmp_path / "0", tmp_path / "1")
    if hasattr(
        load_script(script).Args, "actor_lag"
    ):  # where none is given, the schedule --deterministic takes
        assert json.loads((tmp_path / "0" / "config.json").read_text())["actor_lag"] == own.get(
            "actor_lag", 1
        )
    # The files too, byte for byte: the stored config names neither run folder (checkpoints.PLACE).
    assert (tmp_path / "0" / "checkpoint.msgpack").read_bytes() == (
        tmp_path / "1" / "checkpoint.msgpack"
    ).read_bytes()
    assert os.environ["XLA_FLAGS"].split() == [
        "--xla_force_host_platform_device_count=1",
        "--xla_gpu_deterministic_ops=true",
    ]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "script, own",
    [
        ("appo_envpool.py", dict(num_splits=2, lstm=True, norm_obs=True, norm_reward=True)),
        # Two actor threads' normaliser turns, rebuilt by their replays (normalize.InTurn.reset).
        (
            "appo_envpool.py",
            dict(num_splits=2, num_actor_threads=2, norm_obs=True, norm_reward=True),
        ),
        ("ppo_sync_baseline.py", dict(lstm=True)),
        (
            "appo_envpool.py",
            dict(env_id="Minesweeper-v0", num_splits=2),
        ),  # the journal holds the joint mask's indices
    ],
)
def test_a_run_stopped_and_resumed_goes_on_as_the_run_uninterrupted(script, own, tmp_path, capsys):
    """SIGTERM after a few updates, then --resume: the envs stepped back through the journal of
    actions, the recurrent states and the normaliser as they were. The final checkpoint is the
    uninterrupted run's, bit for bit, and so is metrics.jsonl, record for record (the update
    scalars are logged on the budget's schedule: none more at the stop or at the resume)."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    argv = flags_of(
        script,
        **{
            **tiny_flags(script),
            "env_id": "CartPole-v1",
            **own,
            "deterministic": True,
            "total_timesteps": 40 * 64,
            "save_interval": 1000,
            "log_frequency": 3,  # the stop and the resume fall between the logged updates
        },
    )
    code, _, err = run_main(script, [*argv, "--run-dir", whole], capsys)
    assert code == 0, err
    code, _, err = sigterm_when(
        script,
        [*argv, "--run-dir", cut],
        tmp_path / "logs",
        lambda: count_complete_lines(cut / "metrics.jsonl", '"losses/loss"') >= 4,
        300,
    )
    assert code == 143, err[-3000:]
    assert 0 < int(read_checkpoint(cut)["state"]["global_step"]) < 40 * 64
    code, _, err = run_main(script, ["--resume", cut], capsys)
    assert code == 0, err
    left, right = (
        jax.tree.leaves(read_checkpoint(whole)["state"]),
        jax.tree.leaves(read_checkpoint(cut)["state"]),
    )
    assert len(left) == len(right) and all(np.array_equal(x, y) for x, y in zip(left, right)), (
        "the checkpoints differ"
    )
    a, b = records(whole), records(cut)
    assert any(r[1].startswith("charts/episodic") for r in a)
    assert a == b, (
        next((x, y) for x, y in zip(a, b) if x != y) if len(a) == len(b) else (len(a), len(b))
    )


def resumed_twice(script, run_dir, argv, capsys):
    """Resume a copy of `run_dir` and `run_dir` itself with `argv`: both reach their budget, and
    end alike, bit for bit (a resume is reproducible from its checkpoint)."""
    copy = run_dir.parent / f"{run_dir.name}-copy"
    shutil.copytree(run_dir, copy)
    for folder in (run_dir, copy):
        code, _, err = run_main(script, ["--resume", folder, *argv], capsys)
        assert code == 0, err
    assert_identical(run_dir, copy)
    return read_checkpoint(run_dir)["state"]


@pytest.mark.timeout(600)
# TD3's loop and schedule are SAC's (the same text: tests/test_scripts.py), so SAC stands for both
# here.
@pytest.mark.parametrize("name", ["dqn", "sac"])
def test_a_replay_run_stopped_and_resumed_reaches_its_budget_reproducibly(name, tmp_path, capsys):
    """A --deterministic replay run holds no parameters but its checkpoint's (its buffer refills):
    the resumed run acts with them until its schedule passes them. It once waited forever for the
    version --actor-lag 1 names before the checkpoint's."""
    script, own = RUNS[name]
    run_dir, budget = tmp_path / "cut", own["total_timesteps"]
    argv = flags_of(
        script, **{"env_id": "CartPole-v1", **own, "deterministic": True, "save_interval": 1000}
    )
    code, _, err = sigterm_when(
        script,
        [*argv, "--run-dir", run_dir],
        tmp_path / "logs",
        lambda: count_complete_lines(run_dir / "metrics.jsonl", '"charts/learning_rate"') >= 6,
        300,
    )
    assert code == 143, err[-3000:]
    assert 0 < int(read_checkpoint(run_dir)["state"]["global_step"]) < budget
    assert int(resumed_twice(script, run_dir, [], capsys)["global_step"]) == budget


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "script, lags", [("appo_envpool.py", (1, 2)), ("impala_envpool.py", (1, 3))]
)
def test_an_on_policy_resume_may_raise_the_actor_lag(script, lags, tmp_path, capsys):
    """The checkpoint carries the parameters the old --actor-lag acts with; the larger lag's first
    rollouts act with the oldest of them (they once waited forever for an older one)."""
    run_dir = tmp_path / "run"
    argv = flags_of(
        script, **{**tiny_flags(script), "env_id": "CartPole-v1", "deterministic": True}
    )
    code, _, err = run_main(script, [*argv, "--actor-lag", lags[0], "--run-dir", run_dir], capsys)
    assert code == 0, err
    state = resumed_twice(
        script, run_dir, ["--actor-lag", lags[1], "--total-timesteps", 4 * TINY_BATCH], capsys
    )
    assert int(state["global_step"]) == 4 * TINY_BATCH


# ---------------------------------------------------------------------------------------------
# The exact comparison: APPO at lag 0 is the sync baseline
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(600)
@pytest.mark.parametrize("env_id, num_steps", [("CartPole-v1", 32), ("HalfCheetah-v4", 32)])
def test_appo_at_lag_0_is_the_sync_baseline_bit_for_bit(env_id, num_steps, tmp_path, capsys):
    """Same seed and flags, 5 updates: APPO --deterministic --actor-lag 0 --no-vtrace (its
    learner takes sync PPO's update on data its own parameters chose, GAE on its own values) and
    ppo_sync_baseline.py end with the same parameters, optimiser state and normaliser (HalfCheetah's
    preset normalises observations and rewards), bit for bit. (At 8 envs: APPO's learner recomputes
    the values that sync's actor recorded, and with 4 envs XLA:CPU's products for the actor's batch
    of 4 round otherwise than the learner's over T x B: 1.4e-6 apart after 5 CartPole updates.)"""
    common = dict(
        env_id=env_id,
        num_envs=8,
        num_steps=num_steps,
        total_timesteps=5 * 8 * num_steps,
        eval_episodes=0,
        seed=7,
        num_minibatches=2,
    )
    for script, own in [
        ("ppo_sync_baseline.py", {}),
        ("appo_envpool.py", dict(deterministic=True, actor_lag=0, vtrace=False, num_splits=1)),
    ]:
        code, _, err = run_main(
            script, [*flags_of(script, **common, **own), "--run-dir", tmp_path / script], capsys
        )
        assert code == 0, err
    sync, appo = (
        read_checkpoint(tmp_path / s)["state"] for s in ("ppo_sync_baseline.py", "appo_envpool.py")
    )
    assert int(sync["policy_version"]) == int(appo["policy_version"]) == 5
    for part in ("params", "opt_state", "norm"):
        left, right = jax.tree.leaves(sync.get(part, {})), jax.tree.leaves(appo.get(part, {}))
        assert len(left) == len(right) and all(np.array_equal(x, y) for x, y in zip(left, right)), (
            part
        )


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "env_id, num_steps, updates", [("CartPole-v1", 16, 5), ("HalfCheetah-v4", 32, 1)]
)
def test_appo_at_lag_0_with_vtrace_is_the_sync_baseline_within_rounding(
    env_id, num_steps, updates, tmp_path, capsys
):
    """With V-trace at lag 0 (ratios 1), APPO's targets are GAE's in exact arithmetic (vtrace's
    lambda), summed in another order: the parameters agree within 1e-6 of sync PPO's. On CartPole
    the rounding changes no discrete action, so 5 updates stay within it (3e-7 measured); on
    HalfCheetah it moves the continuous actions, which MuJoCo amplifies (measured: 6e-8 after 1
    update, 2e-6 after 2, 2e-3 after 3), so the bound holds for the first update."""
    common = dict(
        env_id=env_id,
        num_envs=4,
        num_steps=num_steps,
        total_timesteps=updates * 4 * num_steps,
        eval_episodes=0,
        seed=7,
        num_minibatches=2,
    )
    for script, own in [
        ("ppo_sync_baseline.py", {}),
        ("appo_envpool.py", dict(deterministic=True, actor_lag=0, num_splits=1)),
    ]:
        code, _, err = run_main(
            script, [*flags_of(script, **common, **own), "--run-dir", tmp_path / script], capsys
        )
        assert code == 0, err
    sync, appo = (
        read_checkpoint(tmp_path / s)["state"] for s in ("ppo_sync_baseline.py", "appo_envpool.py")
    )
    differences = [
        float(np.max(np.abs(x - y)))
        for x, y in zip(jax.tree.leaves(sync["params"]), jax.tree.leaves(appo["params"]))
    ]
    assert 0 < max(differences) < 1e-6, (
        differences
    )  # not bit for bit: V-trace's recursion rounds otherwise


# ---------------------------------------------------------------------------------------------
# Devices and processes
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_a_run_on_4_devices_reproduces(tmp_path, monkeypatch):
    """APPO --deterministic on 4 forced CPU devices (2 actor devices, 2 learner devices), twice."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    flags = {
        **tiny_flags("appo_envpool.py"),
        "env_id": "CartPole-v1",
        "deterministic": True,
        "num_splits": 2,
    }
    for i in (0, 1):
        argv = [
            *flags_of("appo_envpool.py", **flags),
            "--actor-device-ids",
            "0",
            "1",
            "--learner-device-ids",
            "2",
            "3",
            "--run-dir",
            tmp_path / str(i),
        ]
        result = run_script("appo_envpool.py", argv, timeout=500)
        assert result.returncode == 0, result.stderr[-3000:]
    assert_identical(tmp_path / "0", tmp_path / "1")


# A run of 2 processes computes what 1 process with 2 devices does: the same actors (their seeds and
# keys are counted over all processes, runs.Run.actors), the same sharded batch, a gloo all-reduce
# where one process sums on its devices (a sum of 2 is exact in either order). So the 2 processes
# learn what the 1-process run learns (tests/test_scale.py learns CartPole on 2 learner devices
# with 2 actor threads), and reproduce as it does: a difference in either would show here.
@pytest.mark.timeout(600)
def test_a_run_of_2_processes_is_the_run_of_1_process_with_2_devices(tmp_path, monkeypatch):
    """APPO --deterministic, 4 updates: 2 jax.distributed processes (gloo) x 1 device against 1
    process whose 2 devices each hold an actor and half the learner; checkpoints bit for bit, and
    the same metrics (process 0 logs the games of both processes)."""
    flags = {
        **tiny_flags("appo_envpool.py"),
        "env_id": "CartPole-v1",
        "deterministic": True,
        "total_timesteps": 512,
    }
    argv = flags_of("appo_envpool.py", **flags)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    results = finish_processes(
        start_processes("appo_envpool.py", [*argv, "--run-dir", tmp_path / "two"], tmp_path),
        tmp_path,
        500,
    )
    assert [code for code, _, _ in results] == [0, 0], results
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    result = run_script(
        "appo_envpool.py",
        [
            *argv,
            "--actor-device-ids",
            "0",
            "1",
            "--learner-device-ids",
            "0",
            "1",
            "--run-dir",
            tmp_path / "one",
        ],
        timeout=500,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert_identical(tmp_path / "two", tmp_path / "one")
    assert int(read_checkpoint(tmp_path / "one")["state"]["policy_version"]) == 4


# ---------------------------------------------------------------------------------------------
# What it refuses
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "script, flags, fragments",
    [
        (
            "appo_envpool.py",
            ["--actor-lag", "0", "--num-splits", "2"],
            ["--actor-lag 0", "--num-splits 1"],
        ),
        ("appo_envpool_xla.py", ["--num-splits", "2"], ["--num-splits 1"]),
    ],
)
def test_what_it_cannot_reproduce_is_one_line(script, flags, fragments, tmp_path):
    result = run_script(
        script, ["--env-id", "CartPole-v1", "--deterministic", *flags, "--run-dir", tmp_path / "r"]
    )
    assert_usage_error(result, *fragments)
    assert not (tmp_path / "r").exists()


def test_the_checks_take_a_shared_normaliser_and_leave_serial_runs_alone(capsys):
    """Actor threads over several actor devices share one normaliser as threads of one device do,
    in turns (normalize.InTurn): no refusal; --serial has no actor to schedule (its loop acts with
    the newest parameters, in turn)."""
    from types import SimpleNamespace

    from jax_async_rl import runs

    base = dict(
        actor_lag=1,
        num_splits=1,
        num_actor_threads=1,
        actor_device_ids=[0],
        norm_obs=True,
        norm_reward=False,
    )
    runs.check_deterministic(SimpleNamespace(**base))
    several = SimpleNamespace(**{**base, "actor_device_ids": [0, 1], "num_actor_threads": 2})
    assert runs.check_deterministic(several) is several
    assert (
        runs.check_deterministic(
            SimpleNamespace(**{**base, "actor_lag": None, "serial": True})
        ).actor_lag
        is None
    )
    # No --actor-lag given: the fixed schedule of lag 1 (Cleanba's actor), not a refusal
    flags = dataclasses.make_dataclass("Flags", [*base, "serial"])(
        **{**base, "actor_lag": None, "serial": False}
    )
    assert runs.check_deterministic(flags).actor_lag == 1
    assert (
        capsys.readouterr().out
        == "note: --deterministic acts on a fixed schedule, and --actor-lag None has none: "
        "--actor-lag 1\n"
    )


def test_deterministic_alone_takes_one_split_in_the_xla_actor_on_images():
    """The XLA actor steps its envs as one split under --deterministic: left out, --num-splits is
    1 there, where the preset gives the Nature CNN's tasks 2 (which a named --num-splits 2 is
    refused for, above)."""
    xla = load_script("appo_envpool_xla.py")
    assert xla.resolve_args(xla.Args(env_id="Pong-v5")).num_splits == 2
    resolved = xla.resolve_xla_args(xla.Args(env_id="Pong-v5", deterministic=True))
    assert resolved.num_splits == 1
