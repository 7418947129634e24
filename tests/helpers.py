"""Helpers shared by the tests: which scripts to test, running one, reading what a run wrote.

Every script runs on the run library (jax_async_rl), whose behaviour is tested once, in the
tests/test_lib_*.py files. What is each script's own (its math, its sampler and learner, its
smoke runs, its learning) is tested per script: the tests take the script's file name as a
parameter. Add a new script to SCRIPT_TABLE (with its own flags there) and they cover it.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import flax.serialization
import numpy as np
import tyro

from jax_async_rl import checkpoints, flags

REPO_ROOT = Path(__file__).resolve().parent.parent

# A tiny budget, common to every script: 2 updates of 4 envs x 16 steps, no evaluation.
# SCRIPT_TABLE adds each script's own tiny-budget flags (a flag only some scripts have).
TINY_FLAGS = {
    "num_envs": 4,
    "num_steps": 16,
    "total_timesteps": 128,
    "eval_episodes": 0,
    "log_frequency": 1,  # every update's scalars, as the tests that wait for them expect
}
TINY_BATCH = TINY_FLAGS["num_envs"] * TINY_FLAGS["num_steps"]

# Everything that differs between the scripts, in one table (flag names as in `Args`):
#   tiny:         flags added to TINY_FLAGS for a tiny budget (2 minibatches, 1 epoch, 2 splits)
#   diverge:      flags with which the first update after a resume gets a non-finite loss or
#                 non-finite parameters, so that no checkpoint is written after it
#   bad_inputs:   {case: (flags, fragments the error line must name)}, for flags of this script only
#   variants:     {name: flags} of extra smoke runs on CartPole-v1 (execution modes that must work;
#                 --lstm's is tests/test_lstm.py's saves-resumes-and-evaluates run, of every script)
#   extra_tags:   tags logged after an update besides UPDATE_TAGS
#   learning_timesteps: CartPole-v1 budget at default flags within which 20 consecutive episodes
#                 average >= 475 and the last 20 still average >= 200 (measured, with margin; see
#                 the comments and test_learns_cartpole)
#   asynchronous: actor and learner threads (actor_loop, make_update, Shared:
# tests/test_pipeline.py)   presets:      {env id: flags its preset must give}, typed from the
# published sources the                 scripts cite (rl-baselines3-zoo's ppo.yml / a2c.yml,
# CleanRL, TorchBeast)
PPO_TINY = {"num_minibatches": 2, "update_epochs": 1}
ASYNC_TINY = {"num_splits": 2, "queue_size": 2}
ASYNC_TAGS = [
    "async/policy_lag_mean",
    "async/policy_lag_max",
    "async/stale_fraction",
    "timing/queue_size",
    "timing/queue_put_seconds",
    "timing/update_seconds",
]
ASYNC_BAD_INPUTS = {
    "splits-do-not-divide": (dict(num_splits=3), ["--num-splits", "--num-envs"]),
    "zero-queue-size": (dict(queue_size=0), ["--queue-size"]),
    "negative-policy-lag": (dict(max_policy_lag=-1), ["--max-policy-lag"]),
}
PPO_BAD_INPUTS = {
    "minibatches-do-not-divide": (dict(num_minibatches=3), ["--num-minibatches"]),
    # 8 divides 4 envs x 16 steps but not the 4 envs: a minibatch would split an env's sequence
    "lstm-minibatches-split-envs": (
        dict(lstm=True, num_minibatches=8),
        ["--num-minibatches", "--num-envs", "--lstm"],
    ),
}
# rl-baselines3-zoo hyperparams/ppo.yml (batch_size 64 -> minibatch counts at 8 envs), CleanRL.
PPO_PRESETS = {
    "CartPole-v1": dict(
        num_steps=32,
        learning_rate=1e-3,
        gamma=0.98,
        gae_lambda=0.8,
        update_epochs=20,
        ent_coef=0.0,
        anneal_clip=True,
    ),
    "Pendulum-v1": dict(
        num_steps=1024,
        learning_rate=1e-3,
        gamma=0.9,
        gae_lambda=0.95,
        update_epochs=10,
        norm_obs=False,
    ),
    "LunarLander-v2": dict(
        num_steps=1024,
        gamma=0.999,
        gae_lambda=0.98,
        update_epochs=4,
        ent_coef=0.01,
        num_minibatches=128,
    ),
    "Acrobot-v1": dict(
        num_steps=256, gamma=0.99, gae_lambda=0.94, update_epochs=4, norm_obs=True, norm_reward=True
    ),
    "MountainCar-v0": dict(
        num_steps=16, gamma=0.99, gae_lambda=0.98, update_epochs=4, norm_obs=True, norm_reward=True
    ),
    "HalfCheetah-v4": dict(
        num_steps=256, learning_rate=3e-4, update_epochs=10, norm_obs=True, norm_reward=True
    ),
    "Pong-v5": dict(
        num_steps=128, learning_rate=2.5e-4, clip_coef=0.1, ent_coef=0.01, norm_obs=False
    ),
    # No preset of its own: CleanRL's ppo.py defaults.
    "MountainCarContinuous-v0": dict(
        num_steps=128, learning_rate=2.5e-4, update_epochs=4, ent_coef=0.01, norm_obs=False
    ),
}
# rl-baselines3-zoo hyperparams/a2c.yml, TorchBeast (Atari), Cleanba (MuJoCo).
IMPALA_PRESETS = {
    "CartPole-v1": dict(
        num_steps=5, learning_rate=7e-4, gamma=0.99, entropy_cost=0.0, norm_obs=False
    ),
    "Pendulum-v1": dict(
        num_steps=8, learning_rate=7e-4, gamma=0.9, norm_obs=True, norm_reward=True
    ),
    "LunarLander-v2": dict(num_steps=5, learning_rate=8.3e-4, gamma=0.995, entropy_cost=1e-5),
    "Acrobot-v1": dict(num_steps=5, learning_rate=7e-4, norm_obs=True, norm_reward=True),
    "MountainCar-v0": dict(num_steps=5, learning_rate=7e-4, norm_obs=True, norm_reward=True),
    "HalfCheetah-v4": dict(num_steps=20, learning_rate=3e-4, norm_obs=True, norm_reward=True),
    "Pong-v5": dict(num_steps=80, learning_rate=4.8e-4, entropy_cost=0.0006, norm_obs=False),
    "MountainCarContinuous-v0": dict(num_steps=5, learning_rate=7e-4, gamma=0.99, norm_obs=False),
}
SCRIPT_TABLE = {
    "ppo_sync_baseline.py": dict(
        tiny=PPO_TINY,
        # Adam moves every parameter by ~lr after the first minibatch: ~1e30, then the second
        # minibatch's loss is non-finite.
        diverge=dict(learning_rate=1e30, max_grad_norm=1e30, update_epochs=2),
        bad_inputs=PPO_BAD_INPUTS,
        variants={},
        extra_tags=[],
        # ~30k-60k steps needed (measured: 50k fails on some seeds, 100k scored 500 on the last
        # 20 episodes on seeds 1-5).
        learning_timesteps=100_000,
        asynchronous=False,
        presets=PPO_PRESETS,
    ),
    "appo_envpool.py": dict(
        tiny=dict(PPO_TINY, **ASYNC_TINY),
        diverge=dict(learning_rate=1e30, max_grad_norm=1e30, update_epochs=2),
        bad_inputs=dict(PPO_BAD_INPUTS, **ASYNC_BAD_INPUTS),
        variants={
            "num-splits-1": dict(num_splits=1),
            "no-vtrace": dict(vtrace=False),
            "lstm-num-splits-1": dict(lstm=True, num_splits=1),
        },
        extra_tags=ASYNC_TAGS,
        # Measured at 150k: seeds 1-20 reached a 20-episode mean >= 475 at 19k-53k steps; all 25
        # runs (seeds 1-20, seed 1 five more times) ended at 500, but one CI run ended at 388.
        learning_timesteps=150_000,
        asynchronous=True,
        presets=PPO_PRESETS,
    ),
    "impala_envpool.py": dict(
        tiny=dict(ASYNC_TINY),
        # One RMSProp step per update, |step| <= lr * 10 (eps outside the root): with lr 1e38 the
        # first update's parameters overflow float32.
        diverge=dict(learning_rate=1e38, max_grad_norm=1e30),
        bad_inputs=dict(ASYNC_BAD_INPUTS),
        variants={"num-splits-1": dict(num_splits=1)},
        extra_tags=ASYNC_TAGS,
        # The budget. Measured with the classic preset (5-step unrolls, RMSProp 7e-4):
        # seeds 1 and 2 passed at 1M twice each (500 from 200k-300k steps on); at 500k, 3 runs
        # of 4 passed, but one (seed 1) collapsed from 454 at 100k to 92 at the end.
        learning_timesteps=1_000_000,
        asynchronous=True,
        presets=IMPALA_PRESETS,
    ),
    # APPO with the XLA actor: APPO's flags; its actor is tested against a replay
    # (test_xla_actor.py).
    "appo_envpool_xla.py": dict(
        tiny=dict(PPO_TINY, **ASYNC_TINY),
        diverge=dict(learning_rate=1e30, max_grad_norm=1e30, update_epochs=2),
        bad_inputs=dict(PPO_BAD_INPUTS, **ASYNC_BAD_INPUTS),
        variants={"num-splits-1": dict(num_splits=1)},
        extra_tags=ASYNC_TAGS,
        # APPO's budget and criteria (measured with --xla-actor before it became this script).
        learning_timesteps=150_000,
        asynchronous=True,
        presets=PPO_PRESETS,
    ),
}

# The scripts that tests/test_scripts.py is parametrized over; those with the Python actor
# (Trajectories, actor_loop), that tests/test_pipeline.py is parametrized over.
SCRIPTS = list(SCRIPT_TABLE)
ASYNC_SCRIPTS = [name for name, row in SCRIPT_TABLE.items() if row["asynchronous"]]
PYTHON_ACTOR_SCRIPTS = ["appo_envpool.py", "impala_envpool.py"]

# Tags every script logs after an update (docs/DESIGN.md, "Shared tag names").
UPDATE_TAGS = [
    "charts/SPS",
    "losses/policy_loss",
    "losses/value_loss",
    "losses/entropy",
    "losses/approx_kl",
    "losses/clipfrac",
]

CHECKPOINT = "checkpoint.msgpack"


def tiny_flags(script):
    """The tiny-budget flags of `script`: TINY_FLAGS plus its row's `tiny` flags."""
    return {**TINY_FLAGS, **SCRIPT_TABLE[script]["tiny"]}


def cli(script, env_id="CartPole-v1", **flags):
    """Command-line flags of `script`: its tiny budget (tiny_flags) overridden by `flags`.

    None drops a flag; True / False give tyro's `--flag` / `--no-flag` switches.
    """
    merged = {**tiny_flags(script), **flags}
    argv = ["--env-id", env_id]
    for name, value in merged.items():
        flag = name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            argv += [f"--{flag}", str(value)]
    return argv


def load_script(name):
    """Import a script from the repository root by file name (nothing runs at import)."""
    return checkpoints.load_script(REPO_ROOT / name)


def run_main(script, argv_or_args, capsys=None):
    """`script`'s main in this process (as its command line calls it: the flags given replace a
    resumed run's own); its exit code, and with `capsys` (out, err). `argv_or_args`: a list of
    command-line tokens (cli()) or an Args."""
    module = load_script(script)
    if isinstance(argv_or_args, list):
        argv = [str(x) for x in argv_or_args]
        args, given = tyro.cli(module.Args, args=argv), flags.flags_given(argv, module.Args)
    else:
        args, given = argv_or_args, None
    code = flags.reported(lambda: module.main(args, given))  # as flags.command_line reports errors
    if capsys is None:
        return code
    out, err = capsys.readouterr()
    return code, out, err


def evaluate_here(argv, capsys):
    """`python utils/evaluate.py argv...` in this process (its command line, flags.run_tool; no
    subprocess's ~3 s of imports): (exit code, stdout, stderr)."""
    import pytest

    evaluate = load_script("utils/evaluate.py")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        flags.run_tool(evaluate.main, evaluate.EvalArgs, [str(token) for token in argv])
    out, err = capsys.readouterr()
    return exited.value.code, out, err


def run_script(script, argv, timeout=600):
    """Run `python script argv...` from the repository root; return the CompletedProcess."""
    return subprocess.run(
        [sys.executable, script, *map(str, argv)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_script(script, argv, log_dir):
    """Start `python script argv...` in the background; stdout/stderr go to files in `log_dir`."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "stdout.txt", "w") as out, open(log_dir / "stderr.txt", "w") as err:
        return subprocess.Popen(
            [sys.executable, script, *map(str, argv)], cwd=REPO_ROOT, stdout=out, stderr=err
        )


def sigterm_when(script, argv, log_dir, ready, timeout):
    """Start `python script argv...`, send SIGTERM once `ready()` holds (within `timeout` s),
    and wait up to 30 s for it to exit; return (exit code, seconds from signal to exit, stderr)."""
    proc = start_script(script, argv, log_dir)
    try:
        wait_until(ready, proc, timeout)
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        returncode = proc.wait(timeout=30)
        stop_seconds = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return returncode, stop_seconds, (Path(log_dir) / "stderr.txt").read_text()


def describe(result):
    """The tail of a finished run's output, for assertion messages."""
    return (
        f"exit code {result.returncode}\n--- stdout ---\n{result.stdout[-3000:]}\n--- stderr "
        f"---\n{result.stderr[-3000:]}"
    )


def assert_ok(result):
    assert result.returncode == 0, describe(result)
    assert "Traceback" not in result.stderr, describe(result)


def assert_usage_error(result, *fragments):
    """Exit code 2, exactly one non-empty line on stderr, `error: ...` naming every fragment."""
    assert result.returncode == 2, describe(result)
    assert "Traceback" not in result.stderr, describe(result)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{result.stderr}"
    assert lines[0].startswith("error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"


def interrupt(proc, signum, logs):
    """Send `signum`, wait for the exit; (exit code, seconds from signal to exit, stderr)."""
    try:
        proc.send_signal(signum)
        start = time.monotonic()
        returncode = proc.wait(timeout=30)
        return returncode, time.monotonic() - start, (logs / "stderr.txt").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def help_flags(text: str) -> dict:
    """{flag field name: its help text} from a script's --help (flags.help_text's layout: a line
    "  --flag METAVAR", then its text indented by 6)."""
    options, flag = {}, None
    for line in text.splitlines():
        if line.startswith("  --"):
            flag = line.split()[0][2:].replace("-", "_")
            options[flag] = ""
        elif flag and line.startswith("      "):
            options[flag] = (options[flag] + " " + line.strip()).strip()
        else:
            flag = None
    return options


def interrupt_once_training(proc, folders, timeout=240):
    """Ctrl-C to a launcher `proc` once every run folder of `folders` has logged an update; return
    its (stdout, stderr) after it exits (killed if it has not within a minute)."""
    try:
        wait_until(
            lambda: all(
                (f / "metrics.jsonl").exists() and '"losses/' in (f / "metrics.jsonl").read_text()
                for f in folders
            ),
            proc,
            timeout,
        )
        proc.send_signal(signal.SIGINT)
        return proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


def wait_until(predicate, proc, timeout):
    """Poll `predicate` until true; fail if `proc` exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(
                f"the run exited with code {proc.returncode} before the condition held"
            )
        time.sleep(0.2)
    raise AssertionError(f"condition not reached within {timeout} s")


def count_complete_lines(path, substring):
    """Lines of a file being written that are complete (newline-terminated) and hold `substring`."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return 0
    return sum(substring in line for line in text.split("\n")[:-1])


def read_metrics(run_dir):
    """metrics.jsonl as a list of dicts, checking the schema of every line (DESIGN.md)."""
    records = []
    with open(Path(run_dir) / "metrics.jsonl") as f:
        for number, line in enumerate(f, 1):
            record = json.loads(line)
            where = f"metrics.jsonl line {number}: {line.strip()}"
            assert set(record) == {"step", "wall_time", "tag", "value"}, where
            assert type(record["step"]) is int and record["step"] >= 0, where
            assert type(record["wall_time"]) is float, where
            assert type(record["tag"]) is str and record["tag"], where
            assert type(record["value"]) is float, where
            records.append(record)
    return records


def tag_values(records, tag):
    return [r["value"] for r in records if r["tag"] == tag]


def tag_steps(records, tag):
    return [r["step"] for r in records if r["tag"] == tag]


def file_contents(folder):
    """{name: bytes} of the files directly in `folder`, to check that nothing changed them."""
    return {p.name: p.read_bytes() for p in Path(folder).iterdir() if p.is_file()}


def read_checkpoint(path):
    """The checkpoint's payload as nested dicts (flax msgpack; `path` may be a run folder)."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT
    return flax.serialization.msgpack_restore(path.read_bytes())


def write_crafted_run(folder, script, config: dict, script_path=None):
    """A run folder as anyone could hand one over (a shared result): a checkpoint whose config
    and recorded script path are whatever its author wrote. Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    payload = {
        "state": {"global_step": 0, "policy_version": 0},
        "config": json.dumps(config),
        "script": script,
    }
    if script_path is not None:
        payload["script_path"] = str(script_path)
    (folder / CHECKPOINT).write_bytes(flax.serialization.msgpack_serialize(payload))
    return folder


def marker_code(marker) -> str:
    """A module's text that, imported, writes the file `marker`: a stand-in for any code."""
    return f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"


def check_run_files(script, run_dir, env_id, min_step):
    """Check config.json, metrics.jsonl, TensorBoard events and the checkpoint of a run of
    `script`; return the metrics.

    `min_step`: the budget in environment steps that the run must have reached.
    """
    run_dir = Path(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["env_id"] == env_id

    records = read_metrics(run_dir)
    tags = UPDATE_TAGS + SCRIPT_TABLE[script]["extra_tags"]
    for tag in tags:
        values = tag_values(records, tag)
        assert values, f"no {tag} in metrics.jsonl"
        assert all(math.isfinite(v) for v in values), (tag, values)
    assert max(tag_steps(records, "losses/policy_loss")) >= min_step

    events = sorted(run_dir.glob("events.out.tfevents.*"))
    assert events, f"no TensorBoard events file in {os.listdir(run_dir)}"
    event_bytes = b"".join(path.read_bytes() for path in events)
    for tag in tags:
        assert tag.encode() in event_bytes, f"{tag} not in the TensorBoard events"

    payload = read_checkpoint(run_dir)
    state = payload["state"]
    assert {"params", "opt_state", "global_step", "policy_version"} <= set(state)
    assert int(state["global_step"]) >= min_step
    assert json.loads(payload["config"])["env_id"] == env_id
    return records


# Math tests (tests/test_math_*.py)


def random_rollout(rng, T=13, B=5, gamma=0.97):
    """Random rewards and values with episode ends inside the rollout (and on its first/last
    step)."""
    rewards = rng.normal(size=(T, B)).astype(np.float32)
    values = rng.normal(size=(T, B)).astype(np.float32)
    bootstrap_value = rng.normal(size=B).astype(np.float32)
    dones = (rng.random((T, B)) < 0.2).astype(np.float32)
    dones[0, 0] = dones[T - 1, 1] = dones[T // 2, 2] = 1.0
    dones[:, 3] = 0.0  # one column without any episode end
    discounts = (gamma * (1.0 - dones)).astype(np.float32)
    assert (discounts == 0).any() and (discounts > 0).any()
    return rewards, values, bootstrap_value, discounts


def fail_on_call(monkeypatch, cls, method: str, n: int, message: str) -> list:
    """Make `cls.method` raise RuntimeError(message) on its n-th call (fault injection into a
    thread's work); returns the list that receives the time.monotonic() of the failure."""
    calls, failed_at = [], []
    original = getattr(cls, method)

    def faulty(self, *a):
        calls.append(1)
        if len(calls) == n:
            failed_at.append(time.monotonic())
            raise RuntimeError(message)
        return original(self, *a)

    monkeypatch.setattr(cls, method, faulty)
    return failed_at


def live(pids) -> list:
    """The processes of `pids` that are running (the process table; a zombie is not)."""
    return [
        pid
        for pid in pids
        if Path(f"/proc/{pid}").exists()
        and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    ]


def gone_within(pids, seconds: float) -> list:
    """The processes of `pids` still running after up to `seconds`: a SIGKILLed process ends when
    the kernel gets to it, a moment later on a loaded machine."""
    deadline = time.monotonic() + seconds
    while live(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return live(pids)
