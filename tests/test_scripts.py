"""Each script in helpers.SCRIPTS run as a user runs it: smoke runs, SIGTERM and resume, bad input,
a diverging loss, and learning CartPole-v1. Subprocesses run one at a time, from the repo root."""

import difflib
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from helpers import (
    CHECKPOINT,
    REPO_ROOT,
    SCRIPT_TABLE,
    TINY_BATCH,
    TINY_FLAGS,
    UPDATE_TAGS,
    assert_ok,
    assert_usage_error,
    check_run_files,
    cli,
    count_complete_lines,
    describe,
    file_contents,
    load_script,
    read_checkpoint,
    read_metrics,
    run_script,
    sigterm_when,
    start_script,
    tag_steps,
    tag_values,
    wait_until,
)

# The start-up tests need a cold start: an update cached by an earlier Pong run loads in seconds.
COLD = ["--compile-cache", ""]

# ---------------------------------------------------------------------------------------------
# The files side by side
# ---------------------------------------------------------------------------------------------


def test_scripts_stand_alone_and_the_async_diff_stays_small():
    """Users copy one script: none imports utils/ or a sibling. `diff ppo_sync_baseline.py
    appo_envpool.py` is how they read what asynchrony changes: under 35% of APPO's lines; `diff
    appo_envpool.py impala_envpool.py` shows the IMPALA loss: under 15% of IMPALA's."""
    sources = {name: (REPO_ROOT / name).read_text().splitlines() for name in SCRIPT_TABLE}
    local = re.compile(r"(from|import) +(utils|ppo_sync_baseline|appo_envpool|impala_envpool)\b")
    for name, lines in sources.items():
        imports = [line for line in lines if local.match(line)]
        assert not imports, (name, imports)
    for old, new, limit in [("ppo_sync_baseline.py", "appo_envpool.py", 0.35), ("appo_envpool.py", "impala_envpool.py", 0.15)]:
        matcher = difflib.SequenceMatcher(None, sources[old], sources[new], autojunk=False)
        changed = sum(j2 - j1 for tag, _, _, j1, j2 in matcher.get_opcodes() if tag != "equal")
        assert changed / len(sources[new]) < limit, f"{changed} of {len(sources[new])} lines of {new} differ from {old}"


# ---------------------------------------------------------------------------------------------
# Smoke runs
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_smoke_cartpole_eval_and_video(script, cartpole_run):
    records = check_run_files(script, cartpole_run, "CartPole-v1", TINY_FLAGS["total_timesteps"])
    returns = tag_values(records, "charts/episodic_return")
    assert returns and all(1 <= r <= 500 for r in returns), returns
    evals = tag_values(records, "eval/episodic_return")
    assert len(evals) == 1 and 1 <= evals[0] <= 500, evals
    videos = list((cartpole_run / "videos").glob("*.mp4"))
    assert len(videos) == 1 and videos[0].stat().st_size > 0, videos
    stderr = (cartpole_run.parent / "stderr.txt").read_text()
    assert "Warning" not in stderr, stderr


SMOKE_VARIANTS = [(name, variant) for name, row in SCRIPT_TABLE.items() for variant in row["variants"]]


@pytest.mark.timeout(300)
def test_log_frequency(script, tmp_path):
    """--log-frequency 3 over 7 updates: the update scalars come after the first update, updates 3
    and 6, and the last; episode returns are logged whatever the frequency."""
    run_dir = tmp_path / "run"
    flags = dict(total_timesteps=7 * TINY_BATCH, log_frequency=3, run_dir=run_dir)
    result = run_script(script, cli(script, **flags), timeout=300)
    assert_ok(result)
    records = read_metrics(run_dir)
    for tag in UPDATE_TAGS + SCRIPT_TABLE[script]["extra_tags"] + ["charts/SPS", "charts/learning_rate"]:
        assert tag_steps(records, tag) == [TINY_BATCH, 3 * TINY_BATCH, 6 * TINY_BATCH, 7 * TINY_BATCH], tag
    assert len(tag_values(records, "charts/episodic_return")) >= 7 * TINY_BATCH // 100


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("script_name", "variant"), SMOKE_VARIANTS)
def test_smoke_variant(script_name, variant, tmp_path):
    """Execution modes of one script (helpers.SCRIPT_TABLE's `variants`, e.g. --num-splits 1,
    --no-vtrace) finish a tiny CartPole-v1 run and log every update tag."""
    flags = SCRIPT_TABLE[script_name]["variants"][variant]
    run_dir = tmp_path / "run"
    result = run_script(script_name, cli(script_name, run_dir=run_dir, **flags), timeout=300)
    assert_ok(result)
    check_run_files(script_name, run_dir, "CartPole-v1", TINY_FLAGS["total_timesteps"])
    config = json.loads((run_dir / "config.json").read_text())
    for name, value in flags.items():
        assert config[name] == value, (name, config[name])


# ---------------------------------------------------------------------------------------------
# Checkpoints: SIGTERM, resume, save/load round trip
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_sigterm_writes_checkpoint_and_resume_continues(script, tmp_path):
    """SIGTERM mid-run: exit 143 within seconds, the newest state checkpointed, the last update's
    scalars logged although --log-frequency was not reached. `--resume` alone then finishes the
    run, and the annealed learning rate of every logged update equals the uninterrupted run's."""
    total = 100 * TINY_BATCH
    whole = tmp_path / "whole"
    assert_ok(run_script(script, cli(script, total_timesteps=total, run_dir=whole), timeout=300))
    run_dir = tmp_path / "run"
    # --log-frequency 1000: the update scalars come at the first update and, on the stop, the last.
    flags = dict(total_timesteps=total, save_interval=1, log_frequency=1000, run_dir=run_dir)
    returncode, stop_seconds, stderr = sigterm_when(
        script, cli(script, **flags), tmp_path / "logs",
        lambda: count_complete_lines(run_dir / "metrics.jsonl", '"charts/episodic_return"') >= 30, 300,
    )
    assert returncode == 128 + signal.SIGTERM, f"exit code {returncode}\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, stderr
    assert stop_seconds < 20

    payload = read_checkpoint(run_dir)
    saved_step = int(payload["state"]["global_step"])
    saved_version = int(payload["state"]["policy_version"])
    records = read_metrics(run_dir)
    logged_steps = tag_steps(records, "losses/policy_loss")
    # The checkpoint holds the newest state, not the one of an earlier save_interval.
    assert logged_steps == [TINY_BATCH, saved_step] and 3 * TINY_BATCH <= saved_step < total, logged_steps
    assert tag_steps(records, "charts/SPS") == logged_steps
    assert saved_version > 0

    assert_ok(run_script(script, ["--resume", run_dir], timeout=300))
    new_records = read_metrics(run_dir)[len(records):]
    assert new_records and min(r["step"] for r in new_records) > saved_step
    final = read_checkpoint(run_dir)["state"]
    assert int(final["global_step"]) == total and int(final["policy_version"]) > saved_version
    expected = {r["step"]: r["value"] for r in read_metrics(whole) if r["tag"] == "charts/learning_rate"}
    assert sorted(expected) == [TINY_BATCH * (i + 1) for i in range(100)]  # --log-frequency 1
    assert min(expected.values()) < 0.02 * max(expected.values())  # it did anneal to ~0
    resumed = [(r["step"], r["value"]) for r in read_metrics(run_dir) if r["tag"] == "charts/learning_rate"]
    assert [step for step, _ in resumed] == [TINY_BATCH, saved_step, saved_step + TINY_BATCH, total]
    for step, value in resumed:
        assert value == pytest.approx(expected[step], rel=1e-6, abs=1e-12), step


def small_state():
    """A state like a script's: params, Adam state after one step (non-zero moments), counters."""
    rng = np.random.default_rng(0)
    params = {
        "params": {
            "Dense_0": {"kernel": rng.normal(size=(4, 3)).astype(np.float32), "bias": rng.normal(size=3).astype(np.float32)},
            "log_std": rng.normal(size=2).astype(np.float32),
        }
    }
    optimizer = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-3))
    opt_state = optimizer.init(params)
    grads = jax.tree.map(lambda x: np.full_like(x, 0.3), params)
    _, opt_state = optimizer.update(grads, opt_state, params)
    return {"params": params, "opt_state": opt_state, "global_step": 12_345, "policy_version": 67}


@pytest.mark.timeout(120)
def test_checkpoint_round_trip_in_process(script, tmp_path):
    module = load_script(script)
    state = small_state()
    args = module.Args(env_id="HalfCheetah-v4", norm_obs=True, norm_reward=True, gamma=0.99)
    normalizer = module.Normalizer(np.zeros(3), 2, True, True, 0.99)
    normalizer.observe(np.arange(12, dtype=np.float64).reshape(4, 3))
    normalizer.reward(np.array([1.0, -2.0]), np.array([False, True]), np.array([0, 1]))
    path = tmp_path / CHECKPOINT
    module.save_checkpoint(str(path), state, args, normalizer)
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT], "temporary file left behind"

    payload = module.read_checkpoint(str(path))
    assert payload["config"]["env_id"] == "HalfCheetah-v4"
    fresh = module.Normalizer(np.zeros(3), 2, True, True, 0.99)
    template = jax.tree.map(np.zeros_like, dict(state, **fresh.state()))
    restored = module.load_checkpoint(payload, template, str(path))
    fresh.load(restored)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for saved, loaded in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        saved, loaded = np.asarray(saved), np.asarray(loaded)
        assert saved.shape == loaded.shape
        np.testing.assert_array_equal(loaded, saved)
    # The normaliser's statistics travel with the state: the restored one normalises the same.
    for saved, loaded in zip((*normalizer.obs_stats, *normalizer.return_stats), (*fresh.obs_stats, *fresh.return_stats)):
        np.testing.assert_array_equal(np.asarray(loaded), np.asarray(saved))
    assert int(read_checkpoint(path)["state"]["global_step"]) == 12_345

    # A template of other shapes is a UsageError (exit code 2).
    other = jax.tree.map(np.zeros_like, dict(state, **fresh.state()))
    other["params"]["params"]["Dense_0"]["kernel"] = np.zeros((5, 3), np.float32)
    with pytest.raises(module.UsageError):
        module.load_checkpoint(payload, other, str(path))
    # Resuming with another env, or with normalisation switched, is refused; --total-timesteps may change.
    for flags in (dict(env_id="Ant-v4"), dict(norm_obs=False)):
        with pytest.raises(module.UsageError, match=f"--{next(iter(flags)).replace('_', '-')} cannot change"):
            module.resume_args(module.Args(resume=str(path), **flags), set(flags))
    resumed, _, changed = module.resume_args(module.Args(resume=str(path), total_timesteps=99), {"total_timesteps"})
    assert changed == {"total_timesteps": 99}
    assert (resumed.env_id, resumed.total_timesteps, resumed.gamma) == ("HalfCheetah-v4", 99, 0.99)
    # A flag given as None (its preset) keeps the run's value: no way around a fixed flag.
    resumed, _, changed = module.resume_args(module.Args(resume=str(path), norm_reward=None), {"norm_reward"})
    assert resumed.norm_reward is True and "norm_reward" not in changed


# ---------------------------------------------------------------------------------------------
# Bad input: exit code 2, one line on stderr, nothing started
# ---------------------------------------------------------------------------------------------


def corrupt_random(run, tmp_path):
    folder = tmp_path / "corrupt"
    folder.mkdir()
    (folder / CHECKPOINT).write_bytes(np.random.default_rng(0).bytes(4096))
    return folder


def corrupt_truncated(run, tmp_path):
    data = (run / CHECKPOINT).read_bytes()
    path = tmp_path / CHECKPOINT
    path.write_bytes(data[: len(data) // 2])
    return path


# id -> (flags, fragments the error line must contain, None or a function (CartPole run folder,
# tmp_path) -> the --resume target)
BAD_INPUTS = {
    "unknown-env-id": (dict(env_id="CartPol-v1"), ["--env-id", "CartPole-v1"], None),
    "zero-envs": (dict(num_envs=0), ["--num-envs"], None),
    "negative-timesteps": (dict(total_timesteps=-5), ["--total-timesteps"], None),
    "zero-log-frequency": (dict(log_frequency=0), ["--log-frequency"], None),
    "resume-missing": (dict(), ["--resume"], lambda run, tmp: tmp / "no_such_run"),
    "resume-random-bytes": (dict(), ["--resume"], corrupt_random),
    "resume-truncated": (dict(), ["--resume"], corrupt_truncated),
    "resume-other-env": (dict(env_id="Acrobot-v1"), ["--resume", "CartPole-v1"], lambda run, tmp: run),
    "resume-with-lstm": (dict(lstm=True), ["--resume", "--lstm", "cannot change"], lambda run, tmp: run),
    "zero-lstm-size": (dict(lstm=True, lstm_size=0), ["--lstm-size"], None),
    "unusable-compile-cache": (dict(compile_cache="/proc/no_such_folder"), ["--compile-cache"], None),
    "norm-obs-on-images": (dict(env_id="Pong-v5", norm_obs="True"), ["--norm-obs", "float observations", "Pong-v5"], None),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input(script, case, tmp_path, request):
    flags, fragments, make_resume = BAD_INPUTS[case]
    flags = dict(flags)
    run = None
    if make_resume is not None:
        run = request.getfixturevalue("cartpole_run")
        flags["resume"] = make_resume(run, tmp_path)
    before = file_contents(run) if run else {}
    check_bad_input(script, flags, fragments, tmp_path)
    if run:
        assert file_contents(run) == before, "the run was modified"


SCRIPT_BAD_INPUTS = [(name, case) for name, row in SCRIPT_TABLE.items() for case in row["bad_inputs"]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("script_name", "case"), SCRIPT_BAD_INPUTS)
def test_bad_input_of_script_flags(script_name, case, tmp_path):
    """Flags that only some scripts have (helpers.SCRIPT_TABLE's `bad_inputs`)."""
    flags, fragments = SCRIPT_TABLE[script_name]["bad_inputs"][case]
    check_bad_input(script_name, flags, fragments, tmp_path)


def check_bad_input(script, flags, fragments, tmp_path):
    """A usage error naming `fragments`, before the run folder is created."""
    out_dir = tmp_path / "out"
    result = run_script(script, cli(script, run_dir=out_dir, **flags), timeout=240)
    assert_usage_error(result, *fragments)
    assert not out_dir.exists(), "the run folder was created before the input was checked"


@pytest.mark.timeout(300)
def test_run_dir_holding_a_run_is_refused(script, cartpole_run, tmp_path):
    """A new run pointed at a folder that holds one would overwrite its checkpoint and config."""
    run = tmp_path / "run"
    shutil.copytree(cartpole_run, run)
    before = file_contents(run)
    result = run_script(script, cli(script, run_dir=run), timeout=240)
    assert_usage_error(result, "--run-dir", "--resume")
    assert file_contents(run) == before
    # A file, and a folder with a config but no checkpoint (a run that failed before saving).
    (tmp_path / "file").write_text("x")
    assert_usage_error(run_script(script, cli(script, run_dir=tmp_path / "file"), timeout=240), "--run-dir", "file")
    (run / CHECKPOINT).unlink()
    assert_usage_error(run_script(script, cli(script, run_dir=run), timeout=240), "--run-dir", "no checkpoint")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script_name", ["ppo_sync_baseline.py"])  # Signals is the same text in all three
def test_ctrl_c_during_start_up_keeps_a_folder_it_did_not_create(script_name, tmp_path):
    """A new run in an existing folder (--run-dir runs/, say) stopped during start-up must not
    delete what was there."""
    folder = tmp_path / "runs"
    (folder / "another_run").mkdir(parents=True)
    (folder / "another_run" / "notes.txt").write_text("keep me")
    logs = tmp_path / "logs"
    proc = start_script(script_name, ["--env-id", "Pong-v5", "--run-dir", folder, *COLD], logs)
    wait_until(lambda: count_complete_lines(logs / "stdout.txt", "updates of") == 1, proc, 240)
    returncode, _, stderr = interrupt(proc, signal.SIGINT, logs)
    assert returncode == 128 + signal.SIGINT and "during start-up" in stderr, stderr
    assert (folder / "another_run" / "notes.txt").read_text() == "keep me"


def test_runs_started_in_the_same_second_get_their_own_folders(script, tmp_path, monkeypatch):
    module = load_script(script)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(module.time, "time", lambda: 1_000_000.0)
    args = module.Args(env_id="CartPole-v1")
    made = [module.make_run_dir(args, resumed=False) for _ in range(3)]
    folders = [folder for folder, created in made]
    assert len(set(folders)) == 3 and all((tmp_path / f).is_dir() for f in folders), folders
    assert all(created for _, created in made)
    # An existing --run-dir (that holds no run) is used, and not counted as created by this run.
    assert module.make_run_dir(module.Args(env_id="CartPole-v1", run_dir=folders[0]), resumed=False) == (folders[0], False)


# ---------------------------------------------------------------------------------------------
# Failure: a diverging loss
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_non_finite_loss_exits_1_and_keeps_checkpoint(script, cartpole_run, tmp_path):
    """Resume a good run with an absurd learning rate: the first update after the resume blows the
    parameters up to ~1e30 after its first minibatch, so its loss is non-finite (deterministic)."""
    run_dir = tmp_path / "run"
    shutil.copytree(cartpole_run, run_dir)
    checkpoint = run_dir / CHECKPOINT
    good_bytes = checkpoint.read_bytes()
    saved_step = int(read_checkpoint(checkpoint)["state"]["global_step"])
    flags = dict(
        SCRIPT_TABLE[script]["diverge"], save_interval=1, total_timesteps=saved_step + 10 * TINY_BATCH, resume=run_dir
    )
    result = run_script(script, cli(script, **flags), timeout=240)
    assert result.returncode == 1, describe(result)
    assert "non-finite" in result.stderr, describe(result)
    assert "Traceback" not in result.stderr, describe(result)
    assert checkpoint.read_bytes() == good_bytes, "the last good checkpoint was overwritten"
    for record in read_metrics(run_dir):
        assert math.isfinite(record["value"]), f"non-finite value logged: {record}"


@pytest.mark.timeout(300)
def test_sigterm_during_evaluation(script, tmp_path):
    """A signal during the final evaluation stops it at once: exit 128 + signal, the finished
    training's checkpoint written, no evaluation score logged."""
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    def in_evaluation():
        if "eval: playing" not in (logs / "stdout.txt").read_text():
            return False
        time.sleep(1)  # from its first line into the evaluation loop
        return True

    returncode, stop_seconds, stderr = sigterm_when(
        script, cli(script, eval_episodes=100_000, run_dir=run_dir), logs, in_evaluation, 240
    )
    assert returncode == 128 + signal.SIGTERM, f"exit code {returncode}\n{stderr[-3000:]}"
    assert "evaluation stopped by signal" in stderr and "Traceback" not in stderr, stderr
    assert stop_seconds < 10
    assert int(read_checkpoint(run_dir)["state"]["global_step"]) >= TINY_FLAGS["total_timesteps"]
    assert not tag_values(read_metrics(run_dir), "eval/episodic_return")


# ---------------------------------------------------------------------------------------------
# A run's life: resume, schedule, progress, start-up signals, TensorBoard, presets
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_resume_continues_the_run(script, cartpole_run, tmp_path):
    """`--resume RUN` alone takes the run's own flags (no --env-id: the default is Pong-v5); a
    finished run says so and changes nothing; a larger --total-timesteps trains exactly the steps
    left; a changed --num-envs trains the rest too; config.json keeps the original flags and
    appends each resume's changes."""
    run = tmp_path / "run"
    shutil.copytree(cartpole_run, run)
    before = file_contents(run)
    saved_step = int(read_checkpoint(run)["state"]["global_step"])
    original = json.loads((run / "config.json").read_text())

    result = run_script(script, ["--resume", run], timeout=240)
    assert_ok(result)
    assert "finished" in result.stdout and "--total-timesteps" in result.stdout, describe(result)
    assert file_contents(run) == before, "resuming a finished run changed its files"

    total = saved_step + 3 * TINY_BATCH
    result = run_script(script, ["--resume", run, "--total-timesteps", total, "--eval-episodes", 0], timeout=300)
    assert_ok(result)
    state = read_checkpoint(run)["state"]
    assert int(state["global_step"]) == total, "the resumed run did not train exactly the steps left"
    config = json.loads((run / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "resumes"} == original, "config.json lost the original flags"
    assert config["resumes"][0]["changed"] == {"total_timesteps": total, "eval_episodes": 0}
    assert config["resumes"][0]["step"] == saved_step
    records = read_metrics(run)
    assert max(tag_steps(records, "losses/policy_loss")) == total

    total_8 = total + 2 * 8 * TINY_FLAGS["num_steps"]
    argv = ["--resume", run, "--total-timesteps", total_8, "--num-envs", 8, "--eval-episodes", 0]
    assert_ok(run_script(script, argv, timeout=300))
    assert int(read_checkpoint(run)["state"]["global_step"]) == total_8
    resumes = json.loads((run / "config.json").read_text())["resumes"]
    assert len(resumes) == 2 and resumes[1]["changed"]["num_envs"] == 8
    assert json.loads(read_checkpoint(run)["config"])["num_envs"] == 8


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


# APPO, whose Pong update (4 epochs x 4 minibatches, unrolled on CPU) compiles for minutes while the
# actor samples. (The sync baseline compiles in its main thread: test_ctrl_c_during_start_up.)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("script_name", ["appo_envpool.py"])
def test_progress_lines_while_the_update_compiles(script_name, tmp_path):
    """Pong at default flags: a progress line every 5 s from the first rollout on, while XLA
    compiles the first update; Ctrl-C then exits 130 within seconds: no traceback, nothing to save."""
    logs, run_dir = tmp_path / "logs", tmp_path / "run"
    proc = start_script(script_name, ["--env-id", "Pong-v5", "--run-dir", run_dir, *COLD], logs)
    progress = re.compile(r"^step +(\d+) sampled +0 learned of 10000000 .*ETA n/a$")  # no update yet
    seen = []  # (time a progress line appeared, env steps sampled)

    def watch():
        lines = (logs / "stdout.txt").read_text().split("\n")[:-1]
        for line in lines[len(seen) + 2:]:  # after the backend and header lines
            match = progress.match(line)
            assert match, f"not a progress line: {line!r}"
            seen.append((time.monotonic(), int(match[1])))
        return bool(seen) and seen[-1][1] > 0

    try:
        wait_until(watch, proc, 240)  # the first rollout is under way
        header = (logs / "stdout.txt").read_text().split("\n")[1]
        assert f"{script_name}: Pong-v5 (preset atari, 2 splits), " in header, header  # images: double buffering
        sampling = time.monotonic()
        wait_until(lambda: watch() and len([t for t, _ in seen if t > sampling]) >= 2, proc, 20)
    finally:
        if proc.poll() is not None or count_complete_lines(run_dir / "metrics.jsonl", '"losses/'):
            proc.kill()
    times = [t for t, _ in seen]
    assert max(b - a for a, b in zip(times, times[1:])) < 8, f"seconds between progress lines: {times}"
    first_line = (logs / "stdout.txt").read_text().splitlines()[0]
    assert first_line.startswith(f"jax {jax.__version__} on cpu: cpu:0"), first_line  # backend and devices
    assert count_complete_lines(run_dir / "metrics.jsonl", '"losses/') == 0, "the first update finished first"
    returncode, stop_seconds, stderr = interrupt(proc, signal.SIGINT, logs)
    assert returncode == 128 + signal.SIGINT, stderr
    assert "Traceback" not in stderr and "during start-up" in stderr, stderr
    assert stop_seconds < 10


@pytest.mark.timeout(300)
def test_ctrl_c_during_start_up(script, tmp_path):
    """Ctrl-C one second after the header line (the policy and the update are compiling): exit
    130 within seconds, one line on stderr, no traceback."""
    logs = tmp_path / "logs"
    proc = start_script(script, ["--env-id", "Pong-v5", "--run-dir", tmp_path / "run", *COLD], logs)
    wait_until(lambda: count_complete_lines(logs / "stdout.txt", "updates of") == 1, proc, 240)
    time.sleep(1)
    returncode, stop_seconds, stderr = interrupt(proc, signal.SIGINT, logs)
    assert returncode == 128 + signal.SIGINT, stderr
    assert stderr.strip().splitlines() == [f"stopped by signal {int(signal.SIGINT)} during start-up: nothing to save"]
    assert stop_seconds < 10
    assert not (tmp_path / "run").exists(), "a new run interrupted before its first update left its folder"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [1.0])
def test_ctrl_c_while_importing(script, delay, tmp_path):
    """Ctrl-C while Python imports JAX, envpool and the rest (the first seconds): the process ends
    at once, by the signal (the shell's 130), with no traceback and without training on."""
    logs = tmp_path / "logs"
    proc = start_script(script, ["--env-id", "CartPole-v1", "--total-timesteps", 10**7, "--run-dir", tmp_path / "run"], logs)
    time.sleep(delay)
    returncode, stop_seconds, stderr = interrupt(proc, signal.SIGINT, logs)
    assert returncode in (-signal.SIGINT, 128 + signal.SIGINT), stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert stop_seconds < 10


@pytest.mark.timeout(120)
def test_tensorboard_reads_the_events(script, cartpole_run):
    """The `tensorboard` command installed with the project lists the run's scalars, and its event
    reader gives the same values as metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tensorboard = shutil.which("tensorboard", path=str(Path(sys.executable).parent)) or shutil.which("tensorboard")
    assert tensorboard, "no tensorboard command next to this Python"
    result = subprocess.run([tensorboard, "--inspect", "--logdir", str(cartpole_run)], capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr
    for tag in UPDATE_TAGS + ["charts/episodic_return", "eval/episodic_return"]:
        assert tag in result.stdout, (tag, result.stdout)
    events = EventAccumulator(str(cartpole_run))
    events.Reload()
    records = read_metrics(cartpole_run)
    for tag in UPDATE_TAGS:
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        want = [(r["step"], r["value"]) for r in records if r["tag"] == tag]
        assert len(got) == len(want) and all(a[0] == b[0] and a[1] == pytest.approx(b[1], rel=1e-6) for a, b in zip(got, want))


# Presets from a published source, per task (helpers.SCRIPT_TABLE's `presets`).
@pytest.mark.timeout(120)
def test_presets_per_task_and_help(script):
    module = load_script(script)
    for env_id, expected in SCRIPT_TABLE[script]["presets"].items():
        args = module.resolve_args(module.Args(env_id=env_id))
        got = {name: getattr(args, name) for name in expected}
        assert got == expected, env_id
    # An explicit flag wins over the preset.
    assert module.resolve_args(module.Args(env_id="Pendulum-v1", gamma=0.5)).gamma == 0.5
    env = dict(os.environ, COLUMNS="300")  # one line per flag and per preset
    result = subprocess.run([sys.executable, script, "--help"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for name, values in module.PRESETS.items():
        assert f"{name}: " + ", ".join(f"{k}={v}" for k, v in values.items()) in result.stdout, name
    options = {}  # flag -> its help text, from rich's box of options
    for line in result.stdout.split("╭─ options")[1].splitlines():
        text = line.strip("│ ")
        if text.startswith("--"):
            flag = text.split()[0].rstrip(",")[2:].replace("-", "_")
            options[flag] = text
        elif options and text:
            options[flag] += " " + text
    preset_flags = {k for values in module.PRESETS.values() for k in values}
    assert preset_flags <= set(options), preset_flags - set(options)
    for flag in preset_flags:
        assert options[flag].endswith("(default: preset)") and "(default: None)" not in options[flag], options[flag]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
@pytest.mark.timeout(120)
def test_track_without_wandb_is_a_usage_error(script, tmp_path):
    check_bad_input(script, dict(track=True), ["--track", "pip install"], tmp_path)


# ---------------------------------------------------------------------------------------------
# Learning
# ---------------------------------------------------------------------------------------------

# HalfCheetah-v4 at default flags (the MuJoCo preset: CleanRL's settings and its observation and
# reward normalisation), seed 1: the budget within which 20 consecutive episodes average > 1000.
# Measured: the sync baseline first passed 1000 at 201k, 184k and 217k steps (seeds 1-3; it is
# repeatable from its seed); APPO at 297k, 305k and 418k (seeds 1, 3, 2), and one other seed-2
# run was at 910 after 500k (APPO runs are not repeatable). CleanRL's PPO is at ~1500-2000 at 1M;
# here 1M gave 3527 (sync, seed 1) and 2427 / 2320 / 1708 (APPO, seeds 1-3).
HALFCHEETAH_BUDGET = {"ppo_sync_baseline.py": 300_000, "appo_envpool.py": 800_000}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("script_name", list(HALFCHEETAH_BUDGET))
def test_learns_halfcheetah_with_normalisation(script_name, tmp_path):
    run_dir = tmp_path / "run"
    argv = [
        "--env-id", "HalfCheetah-v4", "--seed", 1, "--eval-episodes", 0, "--run-dir", run_dir,
        "--total-timesteps", HALFCHEETAH_BUDGET[script_name],
    ]
    assert_ok(run_script(script_name, argv, timeout=850))
    returns = tag_values(read_metrics(run_dir), "charts/episodic_return")
    windows = np.convolve(returns, np.ones(20) / 20, "valid")
    curve = json.dumps([round(float(w)) for w in windows[:: max(1, len(windows) // 40)]])
    assert windows.max() > 1000, f"best 20-episode mean {windows.max():.1f}; means along the run: {curve}"
    assert np.mean(returns[-20:]) > 500, f"last 20 episodes: {returns[-20:]}; means along the run: {curve}"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed, xla_actor", [(1, False), (2, False), (1, True)])
def test_learns_cartpole(script, seed, xla_actor, tmp_path):
    """At default flags; the asynchronous scripts also with --xla-actor (tests/test_xla_actor.py)."""
    if xla_actor and not SCRIPT_TABLE[script]["asynchronous"]:
        pytest.skip("--xla-actor is an asynchronous script's flag")
    run_dir = tmp_path / "run"
    argv = [
        "--env-id", "CartPole-v1", "--seed", seed, "--eval-episodes", 0, "--run-dir", run_dir,
        "--total-timesteps", SCRIPT_TABLE[script]["learning_timesteps"], *["--xla-actor"] * xla_actor,
    ]
    result = run_script(script, argv, timeout=850)
    assert_ok(result)
    returns = tag_values(read_metrics(run_dir), "charts/episodic_return")
    assert len(returns) >= 20
    # Reaches the threshold within the budget: some 20 consecutive episodes average >= 475.
    windows = np.convolve(returns, np.ones(20) / 20, "valid")
    curve = json.dumps([round(float(w)) for w in windows[:: max(1, len(windows) // 40)]])
    assert windows.max() >= 475, f"best 20-episode mean {windows.max():.1f}; means along the run: {curve}"
    # And has not fallen back towards a random policy (~22) at the end. Not ">= 475 at the end":
    # the asynchronous scripts' runs differ run to run (which policy version acts depends on thread
    # timing), and after converging, 2 of 20 APPO runs at 150k had a transient dip (the 20-episode
    # mean down to 130 and 218 for 10k-20k steps, then back to 500); one such dip ended a CI run at 388.
    assert np.mean(returns[-20:]) >= 200, f"last 20 episodes: {returns[-20:]}; means along the run: {curve}"


@pytest.mark.timeout(300)
def test_compile_cache_keeps_the_update(script, tmp_path, monkeypatch):
    """--compile-cache FOLDER keeps the compiled update there, which a later run of the same flags
    loads instead of compiling (the start-up figures are in the README). JAX keeps only what took
    over 1 s to compile, which a tiny update may not take on a fast machine: keep everything here."""
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    cache = tmp_path / "cache"
    assert_ok(run_script(script, cli(script, run_dir=tmp_path / "run", compile_cache=cache)))
    entries = sorted(path.name for path in cache.iterdir())
    assert any(name.startswith("jit_update") for name in entries), entries
    assert_ok(run_script(script, cli(script, run_dir=tmp_path / "run2", compile_cache=cache)))
    assert sorted(path.name for path in cache.iterdir()) == entries  # found, not compiled again
