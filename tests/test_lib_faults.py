"""The run library under faults (through the host script, conftest.LIBRARY_HOST): two runs on one
folder, read-only folders, a full disk, a kill during the first checkpoint write, a damaged
config.json, and curves that stay true (each game its own TensorBoard point; nothing past the
checkpoint after a resume)."""

import argparse
import builtins
import contextlib
import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import LIBRARY_HOST

from helpers import (
    CHECKPOINT,
    TINY_BATCH,
    cli,
    file_contents,
    load_script,
    read_checkpoint,
    read_metrics,
    run_main,
    run_script,
    start_script,
    tag_steps,
    wait_until,
)
from jax_async_rl import checkpoints, runs

HOST = LIBRARY_HOST
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def one_error_line(err: str) -> str:
    lines = [
        line
        for line in err.splitlines()
        if line.strip() and not line.startswith(("note:", "warning:"))
    ]
    assert len(lines) == 1 and lines[0].startswith("error"), err
    assert "Traceback" not in err, err
    return lines[0]


@contextlib.contextmanager
def read_only(folder, monkeypatch, error=errno.EROFS):
    """Writes under `folder` fail as on a read-only file system (or with another errno), in this
    process: the tests run as root, whom file modes do not stop."""
    folder = os.path.abspath(folder)

    def inside(path):
        return isinstance(path, (str, Path)) and os.path.abspath(path).startswith(folder)

    def refuse(path):
        raise OSError(error, os.strerror(error), str(path))

    real_open, real_os_open, real_makedirs, real_replace = (
        builtins.open,
        os.open,
        os.makedirs,
        os.replace,
    )

    def fake_open(path, mode="r", *a, **k):
        if inside(path) and any(c in mode for c in "wax+"):
            refuse(path)
        return real_open(path, mode, *a, **k)

    def fake_os_open(path, flags, *a, **k):
        if inside(path) and flags & WRITE_FLAGS:
            refuse(path)
        return real_os_open(path, flags, *a, **k)

    def fake_makedirs(path, *a, **k):
        if inside(path) and not os.path.isdir(path):
            refuse(path)
        return real_makedirs(path, *a, **k)

    def fake_replace(src, dst, *a, **k):
        if inside(dst):
            refuse(dst)
        return real_replace(src, dst, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(builtins, "open", fake_open)
        m.setattr(os, "open", fake_os_open)
        m.setattr(os, "makedirs", fake_makedirs)
        m.setattr(os, "replace", fake_replace)
        yield


@pytest.mark.timeout(300)
def test_two_runs_on_one_folder_at_once(tmp_path, capsys):
    """Run A trains in --run-dir D; run B, started on D meanwhile, exits 2 with a line naming A's
    pid, and writes nothing there: D holds A's records alone, in one event file."""
    run_dir = tmp_path / "same_dir"
    proc = start_script(
        HOST, cli(HOST, run_dir=run_dir, total_timesteps=400 * TINY_BATCH), tmp_path / "a"
    )
    try:
        wait_until(lambda: (run_dir / "config.json").exists(), proc, 120)
        code, _, err = run_main(HOST, cli(HOST, run_dir=run_dir), capsys)
        assert code == 2 and f"pid {proc.pid}" in one_error_line(err) and "in use" in err, err
        code, _, err = run_main(
            HOST, ["--resume", run_dir, "--total-timesteps", 800 * TINY_BATCH], capsys
        )
        assert code == 2 and f"pid {proc.pid}" in one_error_line(err), err
        assert proc.wait(timeout=240) == 0, (tmp_path / "a" / "stderr.txt").read_text()
    finally:
        proc.kill()
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1
    steps = tag_steps(read_metrics(run_dir), "charts/SPS")
    assert steps == sorted(steps) and len(steps) == len(set(steps)), steps


def test_a_read_only_folder_for_training_resume_and_evaluation(
    host_run_copy, tmp_path, monkeypatch, capsys
):
    """--run-dir on a read-only folder, and --resume of a read-only run: one line naming the path
    and the OS error, exit 1, nothing changed. utils/evaluate.py prints the score, then says that
    it could not write it."""
    empty = tmp_path / "empty"
    empty.mkdir()
    before = file_contents(host_run_copy)
    with read_only(tmp_path, monkeypatch):
        code, _, err = run_main(HOST, cli(HOST, run_dir=empty), capsys)
        assert code == 1 and "Read-only file system" in one_error_line(err) and str(empty) in err, (
            err
        )
        code, _, err = run_main(
            HOST, ["--resume", host_run_copy, "--total-timesteps", 10**6], capsys
        )
        assert (
            code == 1
            and "Read-only file system" in one_error_line(err)
            and str(host_run_copy) in err
        ), err
        evaluate = load_script(Path(__file__).parent.parent / "utils" / "evaluate.py")
        code = evaluate.main(evaluate.EvalArgs(run=str(host_run_copy), episodes=2))
        out, err = capsys.readouterr()
    assert "return over 2 episodes" in out and code == 1, (out, err)
    assert "not written" in one_error_line(err) and "Read-only file system" in err, err
    assert file_contents(host_run_copy) == before and list(empty.iterdir()) == []


def no_space(*args):
    """What a full disk raises from write, flush or fsync: ENOSPC, naming no file."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_stops_with_one_line_and_the_last_checkpoint_resumes(
    tmp_path, monkeypatch, capsys
):
    """ENOSPC from fsync in the second checkpoint's write: exit 1, one line naming the file, the
    first checkpoint intact (no .tmp left), and the run resumes from it once space is back."""
    run_dir = tmp_path / "run"
    real_write, writes = checkpoints.write_atomically, []

    def full_after_one(path, data):
        writes.append(path) if path.endswith(CHECKPOINT) else None
        if len(writes) == 2 and path.endswith(CHECKPOINT):
            with monkeypatch.context() as m:
                m.setattr(os, "fsync", no_space)
                return real_write(path, data)
        return real_write(path, data)

    with monkeypatch.context() as m:
        m.setattr(checkpoints, "write_atomically", full_after_one)
        code, _, err = run_main(
            HOST,
            cli(HOST, run_dir=run_dir, total_timesteps=4 * TINY_BATCH, save_interval=1),
            capsys,
        )
    line = one_error_line(err)
    assert code == 1 and "No space left on device" in line and f"{CHECKPOINT}.tmp" in line, err
    assert "the last good checkpoint is kept" in line, err
    assert int(read_checkpoint(run_dir)["state"]["global_step"]) == TINY_BATCH
    assert not (run_dir / f"{CHECKPOINT}.tmp").exists()
    assert run_main(HOST, ["--resume", run_dir]) == 0
    assert int(read_checkpoint(run_dir)["state"]["global_step"]) == 4 * TINY_BATCH


@pytest.mark.timeout(300)
def test_a_run_folder_moved_mid_run_is_where_the_message_says(tmp_path):
    """The run folder renamed while the run trains: the next checkpoint cannot be written (exit
    1), and the line says where the last good checkpoint is: in the folder's new place."""
    run_dir, moved = tmp_path / "run", tmp_path / "moved"
    proc = start_script(
        HOST, cli(HOST, run_dir=run_dir, total_timesteps=10**6, save_interval=5), tmp_path / "logs"
    )
    try:
        wait_until(lambda: (run_dir / CHECKPOINT).exists(), proc, 200)
        os.rename(run_dir, moved)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    line = one_error_line((tmp_path / "logs" / "stderr.txt").read_text())
    assert (
        code == 1
        and f"the last good checkpoint is kept: {moved / CHECKPOINT} (the run folder was moved"
        in line
    ), line
    assert int(read_checkpoint(moved)["state"]["global_step"]) > 0


@pytest.fixture
def small_disk(tmp_path):
    """A folder on a 400 kB tmpfs: a disk that fills within seconds of logging (mounting needs
    root; elsewhere the test is skipped, and test_lib_logs fakes the full disk in the logger)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(folder)], capture_output=True
    ).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@pytest.mark.timeout(300)
def test_a_full_disk_while_logging_is_one_line(small_disk):
    """The run's disk fills with its logs (no checkpoint due): one line naming the file and the
    OS error, exit 1, nothing after it (no traceback of TensorBoard's writer, at close or exit)."""
    run_dir = small_disk / "run"
    result = run_script(
        HOST, cli(HOST, run_dir=run_dir, total_timesteps=10**6, save_interval=0), timeout=280
    )
    line = one_error_line(result.stderr)
    assert result.returncode == 1 and "No space left on device" in line and str(run_dir) in line, (
        result.stderr
    )


def test_a_full_disk_in_the_writer_itself_keeps_the_old_file(tmp_path, monkeypatch):
    """write_atomically on a full disk: the error names the temporary file, the old content
    stays, no .tmp is left."""
    path = tmp_path / "f"
    checkpoints.write_atomically(str(path), b"old")
    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError, match="No space left") as error:
        checkpoints.write_atomically(str(path), b"new")
    monkeypatch.undo()
    assert error.value.filename == f"{path}.tmp"
    assert path.read_bytes() == b"old" and not (tmp_path / "f.tmp").exists()


def test_every_thread_error_is_reported(tmp_path, capsys):
    """A file system error in one thread and a bug in another: one line for the first, the
    traceback of the second, and the checkpoint kept (nothing more is written)."""
    from jax_async_rl import threads

    errors = [
        ("the learner", OSError(errno.ENOSPC, "No space left on device", "x.tmp"), "trace 1"),
        ("the actor thread", RuntimeError("a bug"), "Traceback: RuntimeError: a bug"),
    ]
    assert threads.report_errors(errors, str(tmp_path / CHECKPOINT), 64) is True
    err = capsys.readouterr().err
    assert "error in the learner: No space left on device: x.tmp (step 64)" in err
    assert "error in the actor thread:\nTraceback: RuntimeError: a bug" in err


@pytest.mark.parametrize("complete", [True, False])
def test_a_kill_during_the_first_checkpoint_write(host_run_copy, complete, capsys):
    """Killed during its first checkpoint's write, a run leaves only checkpoint.msgpack.tmp:
    complete, --resume continues from it and says so; cut short, --resume names it (exit 2)."""
    ckpt = host_run_copy / CHECKPOINT
    data = ckpt.read_bytes()
    ckpt.unlink()
    (host_run_copy / f"{CHECKPOINT}.tmp").write_bytes(data if complete else data[: len(data) // 2])
    step = (
        int(
            checkpoints.read_checkpoint(str(host_run_copy / f"{CHECKPOINT}.tmp"))["state"][
                "global_step"
            ]
        )
        if complete
        else 0
    )
    code, _, err = run_main(
        HOST, ["--resume", host_run_copy, "--total-timesteps", step + 2 * TINY_BATCH], capsys
    )
    if complete:
        assert (
            code == 0 and "complete checkpoint.msgpack.tmp" in err and "resuming from it" in err
        ), err
        assert (host_run_copy / CHECKPOINT).exists() and not (
            host_run_copy / f"{CHECKPOINT}.tmp"
        ).exists()
        assert int(read_checkpoint(host_run_copy)["state"]["global_step"]) == step + 2 * TINY_BATCH
    else:
        assert (
            code == 2 and "incomplete write" in one_error_line(err) and f"{CHECKPOINT}.tmp" in err
        ), err


@pytest.mark.parametrize("content", ["garbage {", "", "[1, 2, 3]", None])
def test_a_damaged_config_is_an_error_that_names_it(host_run_copy, content, capsys):
    """--resume of a run whose config.json is garbage, empty, a list or missing: exit 2, one line
    naming the file; the file is not rewritten and nothing else changes."""
    config = host_run_copy / "config.json"
    if content is None:
        config.unlink()
    else:
        config.write_text(content)
    before = file_contents(host_run_copy)
    code, _, err = run_main(HOST, ["--resume", host_run_copy, "--total-timesteps", 10**6], capsys)
    assert code == 2 and str(config) in one_error_line(err), err
    assert file_contents(host_run_copy) == before


def scalar_events(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_every_game_is_its_own_tensorboard_point(tmp_path):
    """TensorBoard keeps one value a step: every game in metrics.jsonl is there, at a step of its
    own (the sync script reports a rollout's games together, the hardest case)."""
    host_run = tmp_path / "run"
    assert run_main(HOST, cli(HOST, run_dir=host_run, total_timesteps=20 * TINY_BATCH)) == 0
    games = [
        (r["step"], r["value"])
        for r in read_metrics(host_run)
        if r["tag"] == "charts/episodic_return"
    ]
    steps = [step for step, _ in games]
    assert len(games) > 10 and len(set(steps)) == len(steps) and steps == sorted(steps)
    points = scalar_events(host_run, "charts/episodic_return")
    assert [s for s, _ in points] == steps
    assert [v for _, v in points] == pytest.approx([v for _, v in games])


def test_nothing_past_the_checkpoint_survives_a_resume(host_run_copy, capsys):
    """An asynchronous run stopped by a signal has logged games of rollouts it never learned from,
    past its checkpoint (here: written into metrics.jsonl and the events, at steps beyond it). The
    resume cuts them from metrics.jsonl and TensorBoard purges them: both show one run whose
    steps only go forward."""
    from tensorboardX import SummaryWriter

    step = int(read_checkpoint(host_run_copy)["state"]["global_step"])
    stale = [step + 10, step + 20]
    writer = SummaryWriter(str(host_run_copy))
    with open(host_run_copy / "metrics.jsonl", "a") as f:
        for s in stale:
            writer.add_scalar("charts/episodic_return", 999.0, s)
            f.write(
                json.dumps(
                    {"step": s, "wall_time": 0.0, "tag": "charts/episodic_return", "value": 999.0}
                )
                + "\n"
            )
    writer.close()
    code, _, err = run_main(
        HOST, ["--resume", host_run_copy, "--total-timesteps", step + 3 * TINY_BATCH], capsys
    )
    assert code == 0 and "2 records past step" in err, err
    games = [
        (r["step"], r["value"])
        for r in read_metrics(host_run_copy)
        if r["tag"] == "charts/episodic_return"
    ]
    assert 999.0 not in [v for _, v in games]
    steps = [s for s, _ in games]
    assert steps == sorted(steps) and len(set(steps)) == len(steps) and max(steps) > step
    points = scalar_events(host_run_copy, "charts/episodic_return")
    assert 999.0 not in [v for _, v in points] and [s for s, _ in points] == steps


def test_warnings_for_flags_that_cripple_a_run(tmp_path, capsys):
    """--num-steps under 4 gets one warning line, and so does a --max-policy-lag that masks most
    of an update's transitions (81% went unnoticed, in async/stale_fraction only); the runs
    train."""
    code, _, err = run_main(
        HOST, cli(HOST, run_dir=tmp_path / "r", num_steps=2, total_timesteps=8 * 4 * 2), capsys
    )
    assert code == 0 and "warning: --num-steps 2" in err, err
    appo = "appo_envpool.py"
    code, _, err = run_main(
        appo,
        cli(
            appo,
            run_dir=tmp_path / "a",
            max_policy_lag=0,
            total_timesteps=12 * TINY_BATCH,
            num_splits=1,
            log_frequency=1,
        ),
        capsys,
    )
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    # How stale the data is depends on the two threads' pace: the line comes iff an update masked
    # most.
    stale = [r["value"] for r in read_metrics(tmp_path / "a") if r["tag"] == "async/stale_fraction"]
    assert code == 0 and len(stale) == 12 and len(warnings) == (max(stale) > 0.5), (stale, err)
    assert all("--max-policy-lag 0" in line for line in warnings), err
    line = runs.stale_warning({"async/stale_fraction": 0.81}, argparse.Namespace(max_policy_lag=3))
    assert line.startswith("warning: 81% ") and "--max-policy-lag 3" in line
    assert (
        runs.stale_warning({"async/stale_fraction": 0.5}, None) is None
        and runs.stale_warning({}, None) is None
    )
    shutil.rmtree(tmp_path / "a")
    code, _, err = run_main(
        appo, cli(appo, run_dir=tmp_path / "b", total_timesteps=12 * TINY_BATCH), capsys
    )
    assert code == 0 and "warning" not in err, err
