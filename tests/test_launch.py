"""utils/launch.py: a sweep of a grid x seeds on CartPole with tiny budgets, run as a user runs it:
every run trained once, in its own folder; a failed run reported while the others finish; a
stopped sweep resumed by the same command, no run trained twice or lost; Ctrl-C leaving no
process; the plot and the table from the sweep folder; the SLURM script naming every run."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO_ROOT, load_script, read_checkpoint, wait_until

LAUNCH = str(REPO_ROOT / "utils" / "launch.py")
SCRIPT = "ppo_sync_baseline.py"
COMMON = ["--env-id", "CartPole-v1", "--num-steps", "16", "--num-minibatches", "2", "--update-epochs", "1",
          "--eval-episodes", "0", "--compile-cache", ""]


def launch(tmp_path, *argv, budget=256, wait=True):
    cmd = [sys.executable, LAUNCH, SCRIPT, "--out", str(tmp_path), *map(str, argv), "--",
           *COMMON, "--total-timesteps", str(budget)]
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)


def sweep_record(tmp_path, name):
    return json.loads((tmp_path / name / "sweep.json").read_text())


def processes_naming(text: str) -> list:
    """The pids of live processes whose command line contains `text` (the process table)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.mark.timeout(600)
def test_a_grid_sweep_runs_once_each_and_is_plotted(tmp_path):
    """2 x 2 grid x 2 seeds, 2 at a time: 8 folders, each trained to the budget with its own
    flags; sweep.json says done with exit 0 for each; the same command again trains nothing;
    plot.py draws one curve per configuration and tabulates 4 configurations."""
    result = launch(tmp_path, "--grid", "num-envs=4,8", "learning-rate=1e-3,3e-4", "--seeds", 1, 2,
                    "--parallel", 2, "--name", "grid")
    assert result.returncode == 0, result.stdout + result.stderr
    record = sweep_record(tmp_path, "grid")
    assert len(record["runs"]) == 8 and all(r["state"] == "done" and r["exit_code"] == 0 for r in record["runs"])
    names = sorted(p.name for p in (tmp_path / "grid").iterdir() if p.is_dir())
    assert names == sorted(f"num-envs={n}__learning-rate={lr}__seed{s}" for n in (4, 8) for lr in ("1e-3", "3e-4")
                           for s in (1, 2))
    for name in names:
        config = json.loads((tmp_path / "grid" / name / "config.json").read_text())
        assert f"num-envs={config['num_envs']}__" in name and f"seed{config['seed']}" in name
        assert str(config["learning_rate"]) in ("0.001", "0.0003")
        assert config["exp_name"] == "grid__" + name.rsplit("__seed", 1)[0]
        assert read_checkpoint(tmp_path / "grid" / name)["state"]["global_step"] >= 256 - 8 * 16
    stamps = {name: (tmp_path / "grid" / name / "checkpoint.msgpack").stat().st_mtime_ns for name in names}
    again = launch(tmp_path, "--grid", "num-envs=4,8", "learning-rate=1e-3,3e-4", "--seeds", 1, 2,
                   "--parallel", 2, "--name", "grid")
    assert again.returncode == 0 and "8 done" in again.stdout, again.stdout + again.stderr
    assert stamps == {name: (tmp_path / "grid" / name / "checkpoint.msgpack").stat().st_mtime_ns for name in names}

    plot = load_script(REPO_ROOT / "utils" / "plot.py")
    out = tmp_path / "plots"
    assert plot.main(plot.PlotArgs(runs=[str(tmp_path / "grid")], out=str(out), window=2)) == 0
    rows = [line for line in (out / "summary.md").read_text().splitlines() if line.startswith("| CartPole")]
    assert len(rows) == 4 and all("| 2 |" in row for row in rows), rows  # 4 configurations, 2 seeds each
    assert (out / "CartPole-v1.png").stat().st_size > 10_000


@pytest.mark.timeout(300)
def test_a_failed_run_is_reported_and_the_others_finish(tmp_path):
    """--learning-rate -1 is refused (exit 2): that run fails, the other trains; the summary names
    the failed run and its log; the sweep exits 1."""
    result = launch(tmp_path, "--grid", "learning-rate=1e-3,-1", "--seeds", 1, "--name", "bad", "--parallel", 2)
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
    proc = launch(tmp_path, "--seeds", 1, 2, "--parallel", 2, "--name", "stop", budget=budget, wait=False)
    folders = [tmp_path / "stop" / f"default__seed{s}" for s in (1, 2)]
    try:
        wait_until(lambda: all((f / "metrics.jsonl").exists() and '"losses/' in (f / "metrics.jsonl").read_text()
                               for f in folders), proc, 240)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out + err
    time.sleep(1)
    assert processes_naming(str(tmp_path / "stop")) == []
    steps = [int(read_checkpoint(f)["state"]["global_step"]) for f in folders]
    assert all(0 < step < budget for step in steps), steps
    runs = sweep_record(tmp_path, "stop")["runs"]
    assert [r["state"] for r in runs] == ["stopped", "stopped"], [(r["exit_code"], Path(r["log"]).read_text()[-3000:])
                                                                  for r in runs]
    result = launch(tmp_path, "--seeds", 1, 2, "--parallel", 2, "--name", "stop", budget=budget)
    assert result.returncode == 0, result.stdout + result.stderr
    for folder, step in zip(folders, steps):
        config = json.loads((folder / "config.json").read_text())
        assert [r["step"] for r in config["resumes"]] == [step]
        assert int(read_checkpoint(folder)["state"]["global_step"]) == budget // 128 * 128


def test_the_slurm_script_names_every_run(tmp_path):
    result = launch(tmp_path, "--grid", "num-envs=4,8", "--seeds", 1, 2, 3, "--name", "cluster", "--slurm")
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
        assert json.loads((Path(r["dir"]) / "config.json").read_text())["anneal_lr"] is (r["config"] == "anneal-lr=True")


def test_a_sweep_refuses_other_flags_under_its_name(tmp_path):
    """The same --name with other flags after -- would mix two configurations under one curve:
    exit 2, one line, and nothing runs."""
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "sweep.json").write_text(json.dumps({"script": SCRIPT, "common": COMMON, "runs": []}))
    result = launch(tmp_path, "--name", "s", budget=512)
    assert result.returncode == 2 and "new --name" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "s" / "default__seed1").exists()


@pytest.mark.parametrize("argv, fragment", [
    (["--grid", "num-envs", "--name", "x"], "FLAG=V1,V2"),
    (["--grid", "seed=1,2", "--name", "x"], "--seed is the launcher's"),
])
def test_bad_launcher_input_is_one_line(tmp_path, argv, fragment):
    result = launch(tmp_path, *argv)
    assert result.returncode == 2 and fragment in result.stderr and "Traceback" not in result.stderr, result.stderr
