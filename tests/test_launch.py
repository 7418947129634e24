"""utils/launch.py: a sweep of a grid x seeds on CartPole with tiny budgets, run as a user runs it:
every run trained once, in its own folder; a failed run reported while the others finish; a
stopped sweep resumed by the same command, no run trained twice or lost; Ctrl-C leaving no
process; the plot and the table from the sweep folder; the SLURM script naming every run."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import (
    interrupt_once_training,
    REPO_ROOT,
    count_complete_lines,
    load_script,
    read_checkpoint,
    wait_until,
)

LAUNCH = str(REPO_ROOT / "utils" / "launch.py")
SCRIPT = "ppo_sync_baseline.py"
# The runs keep their compiles in the suite's cache (tests/conftest.py): a sweep's runs of one shape
# compile once.
COMMON = [
    "--env-id",
    "CartPole-v1",
    "--num-steps",
    "16",
    "--num-minibatches",
    "2",
    "--update-epochs",
    "1",
    "--eval-episodes",
    "0",
]


def launch(tmp_path, *argv, budget=256, wait=True, common=COMMON):
    cmd = [
        sys.executable,
        LAUNCH,
        SCRIPT,
        "--out",
        str(tmp_path),
        *map(str, argv),
        "--",
        *common,
        "--total-timesteps",
        str(budget),
    ]
    if not wait:
        return subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)


def sweep_record(tmp_path, name):
    return json.loads((tmp_path / name / "sweep.json").read_text())


def processes_naming(text: str) -> list:
    """The pids of live processes whose command line contains `text` (the process table)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            ):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.mark.timeout(600)
def test_a_grid_sweep_runs_once_each_and_is_plotted(tmp_path):
    """2 x 2 grid, 2 at a time: 4 folders, each trained to the budget with its own flags;
    sweep.json says done with exit 0 for each; the same command again trains nothing; plot.py
    draws one curve per configuration and tabulates 4 configurations. (Seeds multiply the grid as
    the SLURM test below counts; plot.py's grouping of seeds: tests/test_utils.py.)"""
    grid = [
        "--grid",
        "num-envs=4,8",
        "learning-rate=1e-3,3e-4",
        "--seeds",
        2,
        "--parallel",
        2,
        "--name",
        "grid",
    ]
    result = launch(tmp_path, *grid)
    assert result.returncode == 0, result.stdout + result.stderr
    record = sweep_record(tmp_path, "grid")
    assert len(record["runs"]) == 4 and all(
        r["state"] == "done" and r["exit_code"] == 0 for r in record["runs"]
    )
    names = sorted(p.name for p in (tmp_path / "grid").iterdir() if p.is_dir())
    assert names == sorted(
        f"num-envs={n}__learning-rate={lr}__seed2" for n in (4, 8) for lr in ("1e-3", "3e-4")
    )
    for name in names:
        config = json.loads((tmp_path / "grid" / name / "config.json").read_text())
        assert f"num-envs={config['num_envs']}__" in name and f"seed{config['seed']}" in name
        assert str(config["learning_rate"]) in ("0.001", "0.0003")
        assert config["exp_name"] == "grid__" + name.rsplit("__seed", 1)[0]
        assert read_checkpoint(tmp_path / "grid" / name)["state"]["global_step"] >= 256 - 8 * 16
    stamps = {
        name: (tmp_path / "grid" / name / "checkpoint.msgpack").stat().st_mtime_ns for name in names
    }
    again = launch(tmp_path, *grid)
    assert again.returncode == 0 and "4 done" in again.stdout, again.stdout + again.stderr
    assert stamps == {
        name: (tmp_path / "grid" / name / "checkpoint.msgpack").stat().st_mtime_ns for name in names
    }

    plot = load_script(REPO_ROOT / "utils" / "plot.py")
    out = tmp_path / "plots"
    assert plot.main(plot.PlotArgs(runs=[str(tmp_path / "grid")], out=str(out), window=2)) == 0
    rows = [
        line
        for line in (out / "summary.md").read_text().splitlines()
        if line.startswith("| CartPole")
    ]
    assert len(rows) == 4 and all("| 1 |" in row for row in rows), (
        rows
    )  # 4 configurations, 1 seed each
    assert (out / "CartPole-v1.png").stat().st_size > 10_000


@pytest.mark.timeout(300)
def test_a_failed_run_is_reported_and_the_others_finish(tmp_path):
    """--learning-rate -1 is refused (exit 2): that run fails, the other trains; the summary names
    the failed run and its log; the sweep exits 1."""
    result = launch(
        tmp_path, "--grid", "learning-rate=1e-3,-1", "--seeds", 1, "--name", "bad", "--parallel", 2
    )
    runs = {r["name"]: r for r in sweep_record(tmp_path, "bad")["runs"]}
    assert result.returncode == 1, result.stdout + result.stderr
    assert runs["learning-rate=1e-3__seed1"]["state"] == "done"
    failed = runs["learning-rate=-1__seed1"]
    assert failed["state"] == "failed" and failed["exit_code"] == 2
    assert f"failed: learning-rate=-1__seed1 (exit 2); log: {failed['log']}" in result.stderr
    assert "--learning-rate must be positive" in Path(failed["log"]).read_text()


@pytest.mark.timeout(600)
def test_ctrl_c_stops_every_run_and_the_same_command_resumes(tmp_path):
    """Ctrl-C while 2 runs train: each writes its checkpoint, the launcher exits 130 and no
    process of the sweep is left (the process table); the same command resumes both from their
    checkpoints (one resume each) and trains them to the budget: none trained twice, none lost."""
    budget = 40_000
    proc = launch(
        tmp_path, "--seeds", 1, 2, "--parallel", 2, "--name", "stop", budget=budget, wait=False
    )
    folders = [tmp_path / "stop" / f"default__seed{s}" for s in (1, 2)]
    out, err = interrupt_once_training(proc, folders)
    assert proc.returncode == 130, out + err
    time.sleep(1)
    assert processes_naming(str(tmp_path / "stop")) == []
    steps = [int(read_checkpoint(f)["state"]["global_step"]) for f in folders]
    assert all(0 < step < budget for step in steps), steps
    runs = sweep_record(tmp_path, "stop")["runs"]
    assert [r["state"] for r in runs] == ["stopped", "stopped"], [
        (r["exit_code"], Path(r["log"]).read_text()[-3000:]) for r in runs
    ]
    result = launch(tmp_path, "--seeds", 1, 2, "--parallel", 2, "--name", "stop", budget=budget)
    assert result.returncode == 0, result.stdout + result.stderr
    for folder, step in zip(folders, steps):
        config = json.loads((folder / "config.json").read_text())
        assert [r["step"] for r in config["resumes"]] == [step]
        assert int(read_checkpoint(folder)["state"]["global_step"]) == budget // 128 * 128


def test_the_slurm_script_names_every_run(tmp_path):
    result = launch(
        tmp_path, "--grid", "num-envs=4,8", "--seeds", 1, 2, 3, "--name", "cluster", "--slurm"
    )
    assert result.returncode == 0 and "sbatch" in result.stdout, result.stderr
    text = (tmp_path / "cluster" / "sweep.sbatch").read_text()
    assert "#SBATCH --array=0-5" in text
    for n in (4, 8):
        for s in (1, 2, 3):
            folder = tmp_path / "cluster" / f"num-envs={n}__seed{s}"
            assert f"--resume {folder}" in text and f"--run-dir {folder}" in text
    assert text.count(" ;;") == 6 and not list((tmp_path / "cluster").glob("*/"))  # nothing ran


def test_a_boolean_grid_value_is_a_switch(tmp_path):
    """tyro's boolean flags take no value: a grid's True / False become --flag / --no-flag (as
    `--anneal-lr True` the script exits 2), and both runs train."""
    result = launch(tmp_path, "--grid", "anneal-lr=True,False", "--parallel", 2, "--name", "switch")
    assert result.returncode == 0, result.stdout + result.stderr
    runs = sweep_record(tmp_path, "switch")["runs"]
    assert sorted(tuple(r["flags"]) for r in runs) == [("--anneal-lr",), ("--no-anneal-lr",)]
    for r in runs:
        assert json.loads((Path(r["dir"]) / "config.json").read_text())["anneal_lr"] is (
            r["config"] == "anneal-lr=True"
        )


def test_a_sweep_refuses_other_flags_under_its_name(tmp_path):
    """The same --name with other flags after -- would mix two configurations under one curve:
    exit 2, one line, and nothing runs."""
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "sweep.json").write_text(
        json.dumps({"script": SCRIPT, "common": COMMON, "runs": []})
    )
    result = launch(tmp_path, "--name", "s", budget=512)
    assert (
        result.returncode == 2
        and "new --name" in result.stderr
        and "Traceback" not in result.stderr
    ), result.stderr
    assert not (tmp_path / "s" / "default__seed1").exists()


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--grid", "num-envs", "--name", "x"], "FLAG=V1,V2"),
        (["--grid", "seed=1,2", "--name", "x"], "--seed is the launcher's"),
        (["--grid", "num-envs=4;touch", "--name", "x"], "'4;touch' names the runs' folders"),
        (
            ["--grid", "num-envs=4,-2", "--name", "x", "--slurm"],
            "--num-envs must be positive, got -2",
        ),
        (
            ["--grid", "num-envs=4,4", "--name", "x"],
            "4 is named twice (its runs would write one folder)",
        ),
    ],
)
def test_bad_launcher_input_is_one_line(tmp_path, argv, fragment):
    result = launch(tmp_path, *argv)
    assert (
        result.returncode == 2 and fragment in result.stderr and "Traceback" not in result.stderr
    ), result.stderr
    assert len(result.stderr.splitlines()) == 1 and not list(tmp_path.iterdir()), result.stderr


@pytest.mark.timeout(600)
def test_a_sweep_stopped_during_start_up_resumes(tmp_path):
    """Ctrl-C while the run compiles (Pong's update, after its header line): the launcher exits 130;
    the same command again trains the run to its budget. (The run left its config.json in the
    folder the launcher had made for log.txt, and every re-run failed: "holds a run that saved
    no checkpoint".)"""
    pong = [
        "--env-id",
        "Pong-v5",
        *COMMON[2:],
        "--compile-cache",
        "",
    ]  # compiled anew, whatever ran before
    proc = launch(tmp_path, "--name", "startup", common=pong, budget=128, wait=False)
    log = tmp_path / "startup" / "default__seed1" / "log.txt"
    try:
        wait_until(lambda: count_complete_lines(log, "updates of") == 1, proc, 240)
        assert "losses/" not in (log.parent / "metrics.jsonl").read_text()  # still compiling
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "during start-up" in log.read_text(), out + err
    result = launch(tmp_path, "--name", "startup", common=pong, budget=128)
    assert result.returncode == 0, result.stdout + result.stderr + log.read_text()[-3000:]
    assert [r["state"] for r in sweep_record(tmp_path, "startup")["runs"]] == ["done"]
    assert int(read_checkpoint(log.parent)["state"]["global_step"]) == 128


def test_a_run_that_saved_no_checkpoint_starts_afresh(tmp_path):
    """A run killed before its first checkpoint (kill -9, the OOM killer) leaves its config.json:
    the launcher clears that attempt, keeps its log, and starts the run again (it failed: "holds
    a run that saved no checkpoint", for good)."""
    folder = tmp_path / "afresh" / "default__seed1"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "metrics.jsonl").write_text("")
    (folder / "log.txt").write_text("the first attempt's output\n")
    result = launch(tmp_path, "--name", "afresh")
    assert result.returncode == 0, result.stdout + result.stderr + (folder / "log.txt").read_text()
    assert (
        (folder / "log.txt")
        .read_text()
        .startswith("the first attempt's output\nlaunch.py: the attempt before")
    )
    assert int(read_checkpoint(folder)["state"]["global_step"]) == 256


@pytest.mark.timeout(600)
def test_one_launcher_per_sweep(tmp_path):
    """A second launcher of a running sweep exits 2 with one line naming the first (both wrote
    sweep.json.tmp, one crashed, and one SIGKILLed its training child); the first goes on."""
    first = launch(
        tmp_path, "--name", "twice", budget=5_000_000, wait=False
    )  # still running when the second starts
    folder = tmp_path / "twice" / "default__seed1"
    try:
        wait_until(
            lambda: (
                (folder / "metrics.jsonl").exists()
                and '"losses/' in (folder / "metrics.jsonl").read_text()
            ),
            first,
            240,
        )
        second = launch(tmp_path, "--name", "twice", budget=5_000_000)
        assert second.returncode == 2, second.stdout + second.stderr
        assert second.stderr.splitlines() == [
            f"error: {tmp_path / 'twice'} is in use by another launcher (pid "
            f"{first.pid} on {os.uname().nodename}); wait for it to end, or pick "
            "another folder"
        ], second.stderr
        assert first.poll() is None and [
            r["state"] for r in sweep_record(tmp_path, "twice")["runs"]
        ] == ["running"]
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130


@pytest.mark.timeout(600)
def test_kill_9_of_the_launcher_stops_its_runs_and_a_relaunch_finishes_them(tmp_path):
    """kill -9 of the launcher while its run trains: the run stops within 10 s with a checkpoint
    (it kept training, orphaned); a relaunch at once waits for it to stop, resumes it and
    finishes: sweep.json says done (it said failed, "in use", and kept saying so)."""
    # 15 s of training on this machine: more than the 10 s the run is given to stop
    budget = 200_000
    proc, relaunch = launch(tmp_path, "--name", "kill", budget=budget, wait=False), None
    folder = tmp_path / "kill" / "default__seed1"
    try:
        wait_until(
            lambda: (
                (folder / "metrics.jsonl").exists()
                and '"losses/' in (folder / "metrics.jsonl").read_text()
            ),
            proc,
            240,
        )
        (child,) = processes_naming(str(folder))
        proc.kill()
        proc.wait(timeout=10)
        killed = time.monotonic()
        relaunch = launch(tmp_path, "--name", "kill", budget=budget, wait=False)
        while time.monotonic() - killed < 10 and child in processes_naming(str(folder)):
            time.sleep(0.1)
        assert child not in processes_naming(str(folder)), "the run outlived its launcher by 10 s"
        out, err = relaunch.communicate(timeout=300)
    finally:
        for p in (proc, relaunch):
            if p is not None and p.poll() is None:
                p.kill()
    assert relaunch.returncode == 0, out + err
    assert [r["state"] for r in sweep_record(tmp_path, "kill")["runs"]] == ["done"]
    config = json.loads((folder / "config.json").read_text())
    assert (
        len(config["resumes"]) == 1
        and int(read_checkpoint(folder)["state"]["global_step"]) == budget // 128 * 128
    )


def test_the_sweep_record_is_written_whole_by_concurrent_writers(tmp_path):
    """Writers of sweep.json at the same time (two launchers before the lock; a launcher and a
    tool) each write a temporary file of their own: none fails, the record is always whole JSON
    and no temporary file is left (a shared sweep.json.tmp: "No such file or directory")."""
    launcher = load_script(REPO_ROOT / "utils" / "launch.py")
    errors = []

    def write(n):
        try:
            for i in range(200):
                launcher.save(tmp_path, {"writer": n, "i": i, "runs": [{"name": "x" * 1000}]})
        except Exception as e:  # noqa: BLE001 (any failure is the finding)
            errors.append(repr(e))

    writers = [threading.Thread(target=write, args=(n,)) for n in range(3)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    assert errors == [] and json.loads((tmp_path / "sweep.json").read_text())["i"] == 199
    assert [p.name for p in tmp_path.iterdir()] == ["sweep.json"]


def test_the_sweep_eta_counts_each_runs_time_left(tmp_path):
    """The sweep's ETA from each running run's own ETA (its log's last progress line) and the
    queued runs, placed --parallel at a time; n/a while no run has one (it said "23 s" and stayed
    there: the mean duration of the runs that had ended, whatever the running ones had left)."""
    launcher = load_script(REPO_ROOT / "utils" / "launch.py")
    now, runs = 1000.0, []
    for name, eta in (("a", "0:01:00"), ("b", "0:00:30"), ("c", None)):
        log = tmp_path / f"{name}.txt"
        progress = f"step 128 sampled 64 learned of 99  SPS 10  ETA {eta}\n" if eta else ""
        log.write_text(
            "jax ...\nstep 64 sampled 0 learned of 99  SPS     n/a  return(last 20) n/a  ETA n/a "
            "(compiling "
            "the first update)\n" + progress
        )
        runs.append({"state": "running" if eta else "queued", "start": now - 30, "log": str(log)})
    # a: 60 s left, b: 30 s, then c (a run takes about (30 + 60 + 30 + 30) / 2 = 75 s) on b's slot:
    # 105 s
    assert launcher.sweep_eta(runs, [], 2, now) == "0:01:45"
    assert (
        launcher.sweep_eta(runs, [40.0], 2, now) == "0:01:10"
    )  # a run took 40 s: c after b, 30 + 40
    assert (
        launcher.sweep_eta(runs, [40.0], 2, now + 20) == "0:01:10"
    )  # each run's own ETA (its log) counts down
    runs[1]["log"] = runs[0]["log"] = str(tmp_path / "c.txt")  # compiling: no ETA
    assert launcher.sweep_eta(runs, [], 2, now) == "n/a (no run has an ETA yet)"


@pytest.mark.parametrize("name", ["lr\ntouch MARKER", "a/b", ".."])
def test_a_name_that_is_not_a_plain_folder_name_is_one_line(tmp_path, name):
    """--name is a folder and SLURM's job name: a newline made #SBATCH --job-name end early and the
    rest of the line run as a command."""
    result = launch(tmp_path, "--name", name, "--slurm")
    assert (
        result.returncode == 2
        and "--name" in result.stderr
        and len(result.stderr.splitlines()) == 1
    ), result.stderr
    assert not list(tmp_path.rglob("sweep.sbatch"))


def test_the_slurm_script_quotes_every_value(tmp_path):
    """Run by bash (with a `python` that records its arguments), the SLURM script passes a folder
    with a space, a quote and a dollar sign, and a flag value that holds a command substitution,
    as they are; nothing runs that the user did not write."""
    out = tmp_path / "it's $HOME dir"
    common = [*COMMON, "--wandb-project", "$(touch MARKER); `touch MARKER2`"]
    result = subprocess.run(
        [
            sys.executable,
            LAUNCH,
            str(REPO_ROOT / SCRIPT),
            "--out",
            str(out),
            "--name",
            "q",
            "--slurm",
            "--",
            *common,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    text = (out / "q" / "sweep.sbatch").read_text()
    assert f"#SBATCH --output='{tmp_path}/it'\"'\"'s $HOME dir/q/slurm_%a.out'" in text
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > argv.txt\n')
    (bin_dir / "python").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_ARRAY_TASK_ID="0")
    ran = subprocess.run(
        ["bash", str(out / "q" / "sweep.sbatch")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 0, ran.stderr
    argv = (tmp_path / "argv.txt").read_text().splitlines()
    assert argv[argv.index("--wandb-project") + 1] == "$(touch MARKER); `touch MARKER2`"
    assert argv[argv.index("--run-dir") + 1] == str(out / "q" / "default__seed1")
    assert not list(tmp_path.glob("MARKER*"))


@pytest.mark.parametrize(
    "grid, fragment",
    [
        (
            "num-envs=4,x",
            "--grid num-envs=x: ppo_sync_baseline.py would refuse it (Error parsing --num-envs",
        ),
        ("learning-rate=3e-4,nan", "--learning-rate must be a finite number, got nan"),
        ("gamma=1.5", "--grid gamma=1.5: ppo_sync_baseline.py would refuse it (--gamma "),
        ("num-envs=4,8\n#SBATCH --x", "holds a control character"),
        ("num-envs=4,8 #x", "'8 #x' names the runs' folders and goes into the SLURM script"),
        ("wandb-project=a,$(touch M)", "'$(touch M)' names the runs' folders"),
        ("wandb-project=`id`", "'`id`'"),
        ("wandb-project=a'b", '"a\'b"'),
        ('wandb-project=a"b', "'a\"b'"),
        ("wandb-project=a;b", "'a;b'"),
        ("wandb-project=..", "'..'"),
        ("exp=../up", "'../up'"),
        ("num-envz=4", "unknown flag --num-envz; did you mean --num-envs?"),
        (
            "num-envs=4,8,4",
            "--grid num-envs=4,8,4: 4 is named twice",
        ),  # two array tasks wrote one folder
    ],
)
def test_a_grid_value_is_checked_before_the_slurm_script_is_written(grid, fragment, tmp_path):
    """The sbatch file runs later, on a cluster: a grid value its runs would refuse (the script's
    own flag types and ranges), or text a shell or a folder name reads otherwise, is one line
    naming it, and nothing is written."""
    launch_module = load_script(REPO_ROOT / "utils" / "launch.py")
    args = launch_module.LaunchArgs(
        script=str(REPO_ROOT / SCRIPT), name="s", grid=[grid], out=str(tmp_path), slurm=True
    )
    with pytest.raises(launch_module.UsageError) as error:
        launch_module.main(args, COMMON)
    assert fragment in str(error.value) and "\n" not in str(error.value).replace(grid, ""), str(
        error.value
    )
    assert not list(tmp_path.iterdir())


def test_a_resume_names_the_sweeps_env_again(tmp_path):
    """A run folder alone never imports a user's env module (the trust model): the launcher's
    resume of a run with a checkpoint names the sweep's --env-id / --env-module again, locally and
    in the SLURM script, so a sweep over a user's env resumes."""
    launch_module = load_script(REPO_ROOT / "utils" / "launch.py")
    run = {
        "name": "default__seed1",
        "config": "default",
        "flags": [],
        "seed": 1,
        "dir": str(tmp_path / "r"),
    }
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "checkpoint.msgpack").write_bytes(b"")
    common = ["--env-id", "Corridor-v0", "--env-module=examples.corridor", "--num-envs", "4"]
    cmd = launch_module.command(SCRIPT, run, common, "x", None)
    assert cmd[1:] == [
        SCRIPT,
        "--resume",
        run["dir"],
        "--env-id",
        "Corridor-v0",
        "--env-module=examples.corridor",
    ]
    args = launch_module.LaunchArgs(script=SCRIPT, name="s", seeds=[1], out=str(tmp_path))
    script = launch_module.slurm_script(args, [run], common)
    assert (
        f"--resume {run['dir']} --env-id Corridor-v0 --env-module=examples.corridor; else" in script
    )
