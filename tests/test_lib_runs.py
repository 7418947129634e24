"""jax_async_rl.runs: a run's life, tested once, through one script (conftest.LIBRARY_HOST, the
cheapest): bad input refused before anything starts, the run folder and config.json, the logging
schedule, resume, the compile cache, TensorBoard, and signals during start-up and evaluation.
What differs between the scripts (their loops' use of the run) is tested per script in
tests/test_scripts.py and tests/test_pipeline.py."""

import importlib.util
import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import LIBRARY_HOST

from helpers import (
    CHECKPOINT,
    TINY_BATCH,
    TINY_FLAGS,
    UPDATE_TAGS,
    assert_ok,
    assert_usage_error,
    cli,
    count_complete_lines,
    file_contents,
    interrupt,
    marker_code,
    read_checkpoint,
    read_metrics,
    run_main,
    run_script,
    sigterm_when,
    start_script,
    tag_steps,
    tag_values,
    wait_until,
    write_crafted_run,
)
from jax_async_rl import folders

HOST = LIBRARY_HOST
COLD = [
    "--compile-cache",
    "",
]  # a cold start: an update cached by an earlier Pong run loads in seconds


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


# id -> (flags, fragments the error line must contain, None or a function (a finished run's
# folder, tmp_path) -> the --resume target)
BAD_INPUTS = {
    "unknown-env-id": (dict(env_id="CartPol-v1"), ["--env-id", "CartPole-v1"], None),
    "zero-envs": (dict(num_envs=0), ["--num-envs"], None),
    "negative-timesteps": (dict(total_timesteps=-5), ["--total-timesteps"], None),
    "zero-log-frequency": (dict(log_frequency=0), ["--log-frequency"], None),
    "nan-coefficient": (dict(ent_coef="nan"), ["--ent-coef", "finite"], None),
    "infinite-learning-rate": (dict(learning_rate="inf"), ["--learning-rate", "finite"], None),
    "budget-under-one-update": (
        dict(total_timesteps=10),
        ["--total-timesteps 10", "one update"],
        None,
    ),
    "resume-missing": (dict(), ["--resume"], lambda run, tmp: tmp / "no_such_run"),
    "resume-random-bytes": (dict(), ["--resume"], corrupt_random),
    "resume-truncated": (dict(), ["--resume"], corrupt_truncated),
    "resume-other-env": (
        dict(env_id="Acrobot-v1"),
        ["--resume", "CartPole-v1"],
        lambda run, tmp: run,
    ),
    "resume-with-lstm": (
        dict(lstm=True),
        ["--resume", "--lstm", "cannot change"],
        lambda run, tmp: run,
    ),
    "zero-lstm-size": (dict(lstm=True, lstm_size=0), ["--lstm-size"], None),
    "unusable-compile-cache": (
        dict(compile_cache="/proc/no_such_folder"),
        ["--compile-cache"],
        None,
    ),
    "norm-obs-on-images": (
        dict(env_id="Pong-v5", norm_obs="True"),
        ["--norm-obs", "float observations", "Pong-v5"],
        None,
    ),
    "unknown-flag": (dict(num_env=4), ["--num-env", "did you mean --num-envs"], None),
    "track-without-wandb": (dict(track=True), ["--track", "pip install"], None),
    "retired-flag": (dict(xla_actor=True), ["--xla-actor", "appo_envpool_xla.py"], None),
    # A checkpoint's config takes the command line's checks, and the line names the file and the key
    "resume-config-wrong-type": (
        dict(),
        [
            f"--resume {{tmp}}/crafted/{CHECKPOINT}: its config has learning_rate "
            '"abc": must be a number'
        ],
        lambda run, tmp: crafted(tmp, learning_rate="abc"),
    ),
    "resume-config-out-of-range": (
        dict(),
        [f"--resume {{tmp}}/crafted/{CHECKPOINT}: its config has gamma 1.5: must be in [0, 1]"],
        lambda run, tmp: crafted(tmp, gamma=1.5),
    ),
}


def crafted(tmp, **config):
    """A crafted run of HOST on CartPole-v1 whose checkpoint's config holds `config` besides."""
    return write_crafted_run(tmp / "crafted", HOST, dict(env_id="CartPole-v1", **config))


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_before_anything_starts(case, host_run, tmp_path, capsys):
    """Exit code 2, one `error:` line naming the flag, no run folder made, a resumed run
    untouched."""
    if case == "track-without-wandb" and importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed")
    flags, fragments, make_resume = BAD_INPUTS[case]
    flags = dict(flags)
    if make_resume is not None:
        flags["resume"] = make_resume(host_run, tmp_path)
    before = file_contents(host_run)
    out_dir = tmp_path / "out"
    if case in ("unknown-flag", "retired-flag"):  # the command line's own check: a subprocess
        result = run_script(HOST, cli(HOST, run_dir=out_dir, **flags), timeout=120)
        assert_usage_error(result, *fragments)
    else:
        code, _, err = run_main(HOST, cli(HOST, run_dir=out_dir, **flags), capsys)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
        for fragment in fragments:
            fragment = fragment.format(tmp=tmp_path)
            assert fragment in lines[0], (fragment, lines[0])
    assert not out_dir.exists(), "the run folder was created before the input was checked"
    assert file_contents(host_run) == before, "the run was modified"


def test_a_bad_flag_from_the_command_line_is_exit_2_with_one_line(tmp_path):
    """The exit code and the single line as a user's shell sees them."""
    out_dir = tmp_path / "out"
    assert_usage_error(
        run_script(HOST, cli(HOST, num_envs=0, run_dir=out_dir), timeout=120), "--num-envs"
    )
    assert not out_dir.exists()


@pytest.mark.parametrize("route", ["env-id", "env-module"])
def test_resuming_a_crafted_folder_runs_no_code(route, tmp_path, monkeypatch, capsys):
    """A checkpoint's config is data: --resume of a folder whose config names an env module
    (`os:system` with a shell command in --env-kwargs, or an --env-module that runs code at
    import) is one line and exit 2, and nothing runs; naming the module again, or
    --trust-env-module, lets it run (the gate is what stopped it)."""
    marker = tmp_path / "marker"
    monkeypatch.chdir(tmp_path)  # the working directory's modules are importable (user_maker)
    if route == "env-id":
        config, allow = (
            dict(env_id="os:system", env_kwargs=json.dumps({"command": f"touch {marker}"})),
            ["--trust-env-module"],
        )
    else:
        (tmp_path / "planted_env_module.py").write_text(marker_code(marker))
        config, allow = (
            dict(env_id="Planted-v0", env_module="planted_env_module"),
            ["--env-module", "planted_env_module"],
        )
    # A file grants no trust
    run = write_crafted_run(tmp_path / "shared_run", HOST, dict(config, trust_env_module=True))
    code, _, err = run_main(HOST, ["--resume", run], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "--trust-env-module" in lines[0], err
    assert ("'os'" if route == "env-id" else "'planted_env_module'") in lines[0], lines[0]
    assert not marker.exists(), "opening a run folder ran its code"
    code, _, err = run_main(HOST, ["--resume", run, *allow], capsys)
    assert code == 2 and marker.exists(), (
        err
    )  # it ran, then the env was refused as no gymnasium.Env


def test_log_frequency(tmp_path):
    """--log-frequency 3 over 7 updates: the update scalars come after the first update, updates 3
    and 6, and the last; episode returns are logged whatever the frequency."""
    run_dir = tmp_path / "run"
    assert (
        run_main(HOST, cli(HOST, total_timesteps=7 * TINY_BATCH, log_frequency=3, run_dir=run_dir))
        == 0
    )
    records = read_metrics(run_dir)
    for tag in UPDATE_TAGS + ["charts/SPS", "charts/learning_rate", "timing/update_seconds"]:
        assert tag_steps(records, tag) == [
            TINY_BATCH,
            3 * TINY_BATCH,
            6 * TINY_BATCH,
            7 * TINY_BATCH,
        ], tag
    assert len(tag_values(records, "charts/episodic_return")) >= 7 * TINY_BATCH // 100
    assert all(math.isfinite(r["value"]) for r in records)


def test_run_dir_holding_a_run_is_refused(host_run_copy, tmp_path, capsys):
    """A new run pointed at a folder that holds one would overwrite its checkpoint and config."""
    run = host_run_copy
    before = file_contents(run)

    def refused(folder, *fragments):
        code, _, err = run_main(HOST, cli(HOST, run_dir=folder), capsys)
        assert code == 2 and all(f in err for f in fragments), err

    refused(run, "--run-dir", "--resume")
    assert file_contents(run) == before
    (tmp_path / "file").write_text("x")
    refused(tmp_path / "file", "--run-dir", "file")
    (run / CHECKPOINT).unlink()  # a run that failed before saving
    refused(run, "--run-dir", "no checkpoint")


def test_runs_started_in_the_same_second_get_their_own_folders(tmp_path, monkeypatch):
    from helpers import load_script

    args = load_script(HOST).Args(env_id="CartPole-v1", exp_name="x")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(folders.time, "time", lambda: 1_000_000.0)
    made = [folders.make(args, resumed=False) for _ in range(3)]
    names = [folder for folder, _, _ in made]
    assert len(set(names)) == 3 and all((tmp_path / f).is_dir() for f in names), names
    assert all(created for _, created, _ in made)
    for _, _, lock in made:
        lock.close()
    # An existing --run-dir (that holds no run) is used, and not counted as created by this run.
    args = load_script(HOST).Args(env_id="CartPole-v1", run_dir=names[0])
    folder, created, lock = folders.make(args, resumed=False)
    lock.close()
    assert (folder, created) == (names[0], False)


def test_the_run_name_says_which_variant_and_a_partial_update_is_said(
    tmp_path, monkeypatch, capsys
):
    """Without --exp-name, the folder and the header name the variant the flags make (the
    script's Args.NAMED: here `--lstm`; an async and a --serial run, TD3 and DDPG, got the same
    name); a budget that is not a whole number of updates is one line saying what will train (it
    stopped short without a word)."""
    monkeypatch.chdir(tmp_path)
    argv = cli(HOST, lstm=True, total_timesteps=3 * TINY_BATCH + 10)
    code, out, err = run_main(HOST, argv, capsys)
    assert code == 0, err
    (folder,) = (tmp_path / "runs").iterdir()
    assert folder.name.startswith("CartPole-v1__ppo_sync_baseline__lstm__1__"), folder.name
    assert (
        f"{HOST} (ppo_sync_baseline__lstm): CartPole-v1 (preset CartPole), 3 updates of " in out
    ), out
    assert err.splitlines() == [
        f"note: --total-timesteps {3 * TINY_BATCH + 10} is not a whole number of updates of 1 "
        f"process x 4 envs x 16 steps = {TINY_BATCH} env steps: 3 updates will train, to step "
        f"{3 * TINY_BATCH}"
    ], err
    assert int(read_checkpoint(folder)["state"]["global_step"]) == 3 * TINY_BATCH


def test_resume_continues_the_run(host_run_copy, capsys):
    """`--resume RUN` alone takes the run's own flags (no --env-id: the default is Pong-v5); a
    finished run says so and changes nothing; a larger --total-timesteps trains exactly the steps
    left; a changed --num-envs trains the rest too; config.json keeps the original flags and
    appends each resume's changes."""
    run = host_run_copy
    before = file_contents(run)
    saved_step = int(read_checkpoint(run)["state"]["global_step"])
    original = json.loads((run / "config.json").read_text())

    code, out, _ = run_main(HOST, ["--resume", run], capsys)
    assert code == 0 and "finished" in out and "--total-timesteps" in out, out
    assert file_contents(run) == before, "resuming a finished run changed its files"

    total = saved_step + 3 * TINY_BATCH
    assert run_main(HOST, ["--resume", run, "--total-timesteps", total, "--eval-episodes", 0]) == 0
    assert int(read_checkpoint(run)["state"]["global_step"]) == total, (
        "the resumed run did not train exactly the steps left"
    )
    config = json.loads((run / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "resumes"} == original, (
        "config.json lost the original flags"
    )
    assert config["resumes"][0]["changed"] == {"total_timesteps": total, "eval_episodes": 0}
    assert config["resumes"][0]["step"] == saved_step
    assert max(tag_steps(read_metrics(run), "losses/policy_loss")) == total

    total_8 = total + 2 * 8 * TINY_FLAGS["num_steps"]
    assert (
        run_main(
            HOST,
            ["--resume", run, "--total-timesteps", total_8, "--num-envs", 8, "--eval-episodes", 0],
        )
        == 0
    )
    assert int(read_checkpoint(run)["state"]["global_step"]) == total_8
    resumes = json.loads((run / "config.json").read_text())["resumes"]
    assert len(resumes) == 2 and resumes[1]["changed"]["num_envs"] == 8
    assert json.loads(read_checkpoint(run)["config"])["num_envs"] == 8


@pytest.mark.timeout(120)
def test_a_run_trained_without_deterministic_does_not_become_so_on_resume(host_run_copy, capsys):
    """Its envs' actions were not journaled, so nothing could replay them: one line at start-up,
    nothing written (it was a traceback from the journal's reader, after config.json had gained a
    resume); the other way, --no-deterministic, is the way out of a damaged journal."""
    run = host_run_copy
    before = file_contents(run)
    code, out, err = run_main(
        HOST, ["--resume", run, "--deterministic", "--total-timesteps", 10 * TINY_BATCH], capsys
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "without --deterministic" in lines[0], err
    assert str(run) in lines[0] and file_contents(run) == before


def test_tensorboard_reads_the_events(host_run):
    """The `tensorboard` command installed with the project lists the run's scalars, and its event
    reader gives the same values as metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tensorboard = shutil.which(
        "tensorboard", path=str(Path(sys.executable).parent)
    ) or shutil.which("tensorboard")
    assert tensorboard, "no tensorboard command next to this Python"
    result = subprocess.run(
        [tensorboard, "--inspect", "--logdir", str(host_run)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 0, result.stderr
    for tag in UPDATE_TAGS + ["charts/episodic_return", "eval/episodic_return"]:
        assert tag in result.stdout, (tag, result.stdout)
    events = EventAccumulator(str(host_run))
    events.Reload()
    records = read_metrics(host_run)
    for tag in UPDATE_TAGS:
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        want = [(r["step"], r["value"]) for r in records if r["tag"] == tag]
        assert len(got) == len(want) and all(
            a[0] == b[0] and a[1] == pytest.approx(b[1], rel=1e-6) for a, b in zip(got, want)
        )


@pytest.mark.timeout(300)
def test_compile_cache_keeps_the_update(tmp_path, monkeypatch):
    """--compile-cache FOLDER keeps the compiled update there, which a later run of the same flags
    loads instead of compiling. JAX keeps only what took over 1 s to compile, which a tiny update
    may not take on a fast machine: keep everything here. (JAX reads the folder once per process:
    subprocesses.)"""
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    cache = tmp_path / "cache"
    assert_ok(run_script(HOST, cli(HOST, run_dir=tmp_path / "run", compile_cache=cache)))
    entries = sorted(path.name for path in cache.iterdir())
    assert any(name.startswith("jit_update") for name in entries), entries
    assert_ok(run_script(HOST, cli(HOST, run_dir=tmp_path / "run2", compile_cache=cache)))
    assert sorted(path.name for path in cache.iterdir()) == entries  # found, not compiled again
    # A resume to a larger budget (the README's recipe) finds the same update: the budget is an
    # argument of the jitted update, not a constant in it (it recompiled: 60 s on Pong).
    monkeypatch.setenv("JAX_LOG_COMPILES", "1")
    # (--compile-cache is the launch's, never restored from the run: named again)
    result = run_script(
        HOST,
        ["--resume", tmp_path / "run", "--total-timesteps", 10 * TINY_BATCH]
        + ["--compile-cache", cache],
    )
    assert_ok(result)
    assert (
        "cache hit for 'jit_update'" in result.stderr
        and "cache miss for 'jit_update'" not in result.stderr
    ), result.stderr[-3000:]
    assert sorted(path.name for path in cache.iterdir()) == entries


@pytest.mark.timeout(300)
def test_ctrl_c_during_start_up(tmp_path):
    """Ctrl-C one second after the header line (the policy and the update are compiling): exit
    130 within seconds, one line on stderr, no traceback; the new run's folder is removed, and a
    folder the run did not create (a launcher's, holding its log.txt) keeps what was in it and
    nothing else, so that the same command starts again (it left config.json: "holds a run that
    saved no checkpoint", for good)."""
    logs = tmp_path / "logs"
    proc = start_script(HOST, ["--env-id", "Pong-v5", "--run-dir", tmp_path / "run", *COLD], logs)
    wait_until(lambda: count_complete_lines(logs / "stdout.txt", "updates of") == 1, proc, 240)
    time.sleep(1)
    returncode, stop_seconds, stderr = interrupt(proc, signal.SIGINT, logs)
    assert returncode == 128 + signal.SIGINT, stderr
    assert stderr.strip().splitlines() == [
        f"stopped by signal {int(signal.SIGINT)} during start-up: nothing to save"
    ]
    assert stop_seconds < 10
    assert not (tmp_path / "run").exists(), (
        "a new run interrupted before its first update left its folder"
    )

    folder = tmp_path / "runs"
    (folder / "another_run").mkdir(parents=True)
    (folder / "another_run" / "notes.txt").write_text("keep me")
    (folder / "log.txt").write_text("a launcher's log\n")
    proc = start_script(HOST, ["--env-id", "Pong-v5", "--run-dir", folder, *COLD], logs)
    wait_until(lambda: count_complete_lines(logs / "stdout.txt", "updates of") == 1, proc, 240)
    assert (folder / "config.json").exists()
    returncode, _, stderr = interrupt(proc, signal.SIGINT, logs)
    assert returncode == 128 + signal.SIGINT and "during start-up" in stderr, stderr
    assert (folder / "another_run" / "notes.txt").read_text() == "keep me"
    assert sorted(path.name for path in folder.iterdir()) == ["another_run", "log.txt"]


@pytest.mark.timeout(300)
def test_sigterm_during_evaluation(tmp_path):
    """A signal during the final evaluation stops it at once: exit 128 + signal, the finished
    training's checkpoint written, no evaluation score logged."""
    run_dir, logs = tmp_path / "run", tmp_path / "logs"

    def in_evaluation():
        if "eval: playing" not in (logs / "stdout.txt").read_text():
            return False
        time.sleep(1)  # from its first line into the evaluation loop
        return True

    returncode, stop_seconds, stderr = sigterm_when(
        HOST, cli(HOST, eval_episodes=100_000, run_dir=run_dir), logs, in_evaluation, 240
    )
    assert returncode == 128 + signal.SIGTERM, f"exit code {returncode}\n{stderr[-3000:]}"
    assert "evaluation stopped by signal" in stderr and "Traceback" not in stderr, stderr
    assert stop_seconds < 10
    assert int(read_checkpoint(run_dir)["state"]["global_step"]) >= TINY_FLAGS["total_timesteps"]
    assert not tag_values(read_metrics(run_dir), "eval/episodic_return")


def test_a_run_in_this_process_leaves_its_signal_handlers_as_it_found_them(tmp_path):
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    assert run_main(HOST, cli(HOST, run_dir=tmp_path / "run")) == 0
    assert (
        run_main(HOST, cli(HOST, num_envs=0, run_dir=tmp_path / "bad")) == 2
    )  # also after a usage error
    assert {s: signal.getsignal(s) for s in handlers} == handlers
