"""utils/launch.py --pbt: population-based training by Sample Factory's rules.

The rules against a plain reading of Sample Factory's (`decide`, `perturb`); a population on
CartPole run as a user runs it: its rounds in pbt.jsonl, a bottom member resumed from a top
member's checkpoint with mutated flags, each member's steps trained once; Ctrl-C mid-round then the
same command continues the round; a member that crashes is replaced; the SLURM job; bad input in
one line.
"""

import json
import random
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import interrupt_once_training, REPO_ROOT, load_script, read_checkpoint

LAUNCH = str(REPO_ROOT / "utils" / "launch.py")
SCRIPT = "appo_envpool.py"
COMMON = ["--env-id", "CartPole-v1", "--eval-episodes", "0"]


def pbt_args(**kw):
    values = dict(
        pbt_replace_fraction=0.3,
        pbt_mutation_rate=0.15,
        pbt_replace_gap=0.1,
        pbt_replace_gap_absolute=1e-6,
    )
    return SimpleNamespace(**dict(values, **kw))


def launch(tmp_path, *argv, budget=6144, wait=True, common=COMMON):
    cmd = [sys.executable, LAUNCH, SCRIPT, "--out", str(tmp_path), "--pbt", *map(str, argv)]
    cmd += ["--", *map(str, common), "--total-timesteps", str(budget)]
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


def rounds(folder) -> list:
    return [json.loads(line) for line in (Path(folder) / "pbt.jsonl").read_text().splitlines()]


def sessions(member):
    """(The steps each session of a member started at, those it paused or stopped at) from its
    log.txt; the last session, which ran to the end, has no end there."""
    text = (Path(member) / "log.txt").read_text()
    starts = [
        int(m.group(1) or 0)
        for m in re.finditer(r"\(preset[^)]*\),(?: resumed at step (\d+):)? \d+ updates", text)
    ]
    ends = [int(m[1]) for m in re.finditer(r"(?:paused|stopped by signal \d+) at step (\d+)", text)]
    return starts, ends


def joined(member):
    """Each session of a member starts where the one before ended: no step trained twice."""
    starts, ends = sessions(member)
    assert starts[0] == 0 and starts[1:] == ends[: len(starts) - 1], (starts, ends)
    return starts, ends


def test_decide_follows_sample_factorys_rules():
    """4 members, top and bottom ceil(0.3 x 4) = 2: the top stays as it is; a bottom member copies
    a top one's flags when the top is better by both gaps, not when within 10%; a crashed member
    (no objective) always copies; the first member never mutates, the others may."""
    launch_module = load_script(str(REPO_ROOT / "utils" / "launch.py"))
    names = ["m0", "m1", "m2", "m3"]
    values = {n: {"learning_rate": 1e-3 * (i + 1)} for i, n in enumerate(names)}
    bounds = {"learning_rate": (None, None, float)}
    defaults = {"learning_rate": 1e-3}
    args = pbt_args(pbt_mutation_rate=1.0)
    out = launch_module.decide(
        names,
        {"m0": 10.0, "m1": 500.0, "m2": 480.0, "m3": None},
        values,
        defaults,
        bounds,
        args,
        random.Random(0),
    )
    assert [out[n]["rank"] for n in names] == [3, 1, 2, 4]
    assert out["m1"] == {"rank": 1, "copies": None, "new": values["m1"]}  # the top: untouched
    assert out["m2"]["copies"] is None and out["m2"]["new"] == values["m2"]
    assert out["m3"]["copies"] in ("m1", "m2")  # crashed: replaced by a top member
    assert out["m0"]["copies"] in ("m1", "m2")  # 10 against 480 or 500
    assert out["m0"]["new"] == values[out["m0"]["copies"]]  # the first: copied, never mutated
    source = values[out["m3"]["copies"]]["learning_rate"]
    factor = out["m3"]["new"]["learning_rate"] / source
    assert 1.1 <= factor <= 1.5 or 1.1 <= 1 / factor <= 1.5 or out["m3"]["new"] == defaults
    # within 10% of the top: no copy
    out = launch_module.decide(
        names,
        {"m0": 470.0, "m1": 500.0, "m2": 480.0, "m3": 460.0},
        values,
        defaults,
        bounds,
        pbt_args(),
        random.Random(1),
    )
    assert all(out[n]["copies"] is None for n in names)


def test_perturb_matches_sample_factorys_factors():
    """Over many draws: a flag changes with probability 0.15, by a factor in [1.1, 1.5] either
    way, back to its default 1 time in 100 of the changes; γ moves its 1 - γ by [1.01, 1.2]; a
    value leaving the flag's range is not taken."""
    launch_module = load_script(str(REPO_ROOT / "utils" / "launch.py"))
    rng = random.Random(0)
    bounds = (None, None, float)
    draws = [launch_module.perturb(1.0, "lr", 2.0, rng, 0.15, bounds) for _ in range(40_000)]
    changed = [d for d in draws if d != 1.0]
    assert abs(len(changed) / len(draws) - 0.15) < 0.01
    defaults = sum(d == 2.0 for d in changed)
    assert 10 < defaults < 150  # 1% of ~6000
    factors = [max(d, 1 / d) for d in changed if d != 2.0]
    assert min(factors) >= 1.1 and max(factors) <= 1.5
    gammas = [launch_module.perturb(0.99, "gamma", 0.99, rng, 1.0, bounds) for _ in range(2000)]
    ratio = [max((1 - g) / 0.01, 0.01 / (1 - g)) for g in gammas]
    assert min(ratio) >= 1.01 - 1e-9 and max(ratio) <= 1.2 + 1e-9
    unit = load_script(str(REPO_ROOT / SCRIPT))
    hint = __import__("typing").get_type_hints(unit.Args, include_extras=True)["gae_lambda"]
    for _ in range(500):  # λ stays in [0, 1]; a user's range clips
        assert (
            0 <= launch_module.perturb(0.999, "gae_lambda", 0.9, rng, 1.0, (None, None, hint)) <= 1
        )
        lr = launch_module.perturb(1e-3, "lr", 1e-3, rng, 1.0, (9e-4, 1.2e-3, float))
        assert 9e-4 <= lr <= 1.2e-3


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--grid", "learning-rate=1e-3", "--pbt-interval", 2048], "a population of 1"),
        (["--seeds", 1, 2], "needs --pbt-interval"),
        (["--seeds", 1, 2, "--pbt-interval", 2048, "--pbt-mutate", "num-envs"], "cannot"),
        (["--seeds", 1, 2, "--pbt-interval", 2048, "--pbt-mutate", "lstm"], "cannot"),
        (["--seeds", 1, 2, "--pbt-interval", 2048, "--pbt-mutate", "learning-rat"], "learning"),
        (["--seeds", 1, 2, "--pbt-interval", 2048, "--pbt-mutate", "clip-coef=-1:1"], "outside"),
        (["--seeds", 1, 2, "--pbt-interval", 2048, "--pbt-mutate", "ent-coef=1:x"], "LOW:HIGH"),
        (["--seeds", 1, 2, "--pbt-interval", 2048, "--pbt-mutate", "=1:2"], "LOW:HIGH"),
        (["--seeds", 1, 2, "--pbt-interval", 2048, "--pbt-mutate", "ent-coef="], "LOW:HIGH"),
    ],
)
def test_bad_population_input_is_one_line(tmp_path, argv, fragment):
    result = launch(tmp_path, "--name", "bad", *argv)
    assert result.returncode == 2, result.stdout + result.stderr
    assert fragment in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_deterministic_is_refused(tmp_path):
    result = launch(
        tmp_path,
        "--name",
        "d",
        "--seeds",
        1,
        2,
        "--pbt-interval",
        2048,
        common=COMMON + ["--deterministic"],
    )
    assert result.returncode == 2 and "--deterministic" in result.stderr, result.stderr


def test_a_population_exploits_and_explores_in_rounds(tmp_path):
    """2 members (learning rates 1e-5 and 1e-3), rounds of 2,048 steps to 6,144: pbt.jsonl records
    each round's ranks, objectives and values; the bottom member resumes from the top one's
    checkpoint with its flags (config.json's resume record and charts/learning_rate say so); each
    member's sessions join end to start, none trained twice; the final evaluation runs once."""
    result = launch(
        tmp_path,
        "--name",
        "p",
        "--grid",
        "learning-rate=1e-5,1e-3",
        "--pbt-interval",
        2048,
        "--parallel",
        2,
        "--pbt-mutation-rate",
        0.0,
        common=COMMON[:2] + ["--eval-episodes", 5],
    )
    assert result.returncode == 0, result.stdout + result.stderr
    folder = tmp_path / "p"
    logged = rounds(folder)
    assert [r["round"] for r in logged] == [0, 1] and [r["step"] for r in logged] == [2048, 4096]
    first = {m["name"]: m for m in logged[0]["members"]}
    slow, fast = "learning-rate=1e-5__seed1", "learning-rate=1e-3__seed1"
    assert first[slow]["old"] == {"learning_rate": 1e-5}
    assert logged[0]["objective"] == "charts/episodic_return, last 100"
    assert sorted(m["rank"] for m in first.values()) == [1, 2]
    copier = [name for name, m in first.items() if m["copies"]]
    for name in copier:
        source = first[name]["copies"]
        assert first[name]["new"] == first[source]["old"]  # rate 0: the source's flags as they were
        config = json.loads((folder / name / "config.json").read_text())
        assert (
            config["resumes"][0]["changed"].get("learning_rate")
            == first[source]["old"]["learning_rate"]
            or first[name]["old"] == first[source]["old"]
        )
    for name in (slow, fast):
        assert joined(folder / name) == ([0, 2048, 4096], [2048, 4096])
        assert int(read_checkpoint(folder / name)["state"]["global_step"]) == 6144
        assert (folder / name / "log.txt").read_text().count("eval: playing 5 episodes") == 1
    record = json.loads((folder / "sweep.json").read_text())
    assert [r["state"] for r in record["runs"]] == ["done", "done"] and record["pbt"]["round"] == 2
    # the population's plot: best and median member, each member's learning rate
    plots = tmp_path / "plots"
    done = subprocess.run(
        [sys.executable, "utils/plot.py", str(folder), "--tag", "eval/episodic_return"]
        + ["--out", str(plots)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and (plots / "p_pbt.png").stat().st_size > 0, done.stderr


def test_ctrl_c_mid_round_then_the_same_command_continues_the_round(tmp_path):
    """Ctrl-C while both members train round 0: each stops with a checkpoint short of the round's
    end (or, one that got there first, paused at it); the same command resumes them to it (not
    past it, not from scratch, not a paused one again), then goes on."""
    argv = ["--name", "c", "--seeds", 1, 2, "--pbt-interval", 32768, "--parallel", 2]
    proc = launch(tmp_path, *argv, budget=40960, wait=False)
    members = [tmp_path / "c" / f"default__seed{s}" for s in (1, 2)]
    out, err = interrupt_once_training(proc, members)
    assert proc.returncode == 130, out + err
    stopped = [int(read_checkpoint(m)["state"]["global_step"]) for m in members]
    assert all(0 < s <= 32768 for s in stopped) and min(stopped) < 32768, stopped
    assert not (tmp_path / "c" / "pbt.jsonl").exists()
    result = launch(tmp_path, *argv, budget=40960)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [r["step"] for r in rounds(tmp_path / "c")] == [32768]
    for member, step in zip(members, stopped):
        starts, ends = joined(member)
        assert step in ends and starts[-1] == 32768 and ends[-1] == 32768, (starts, ends)


def test_a_member_that_crashes_is_replaced_by_exploit(tmp_path):
    """A learning rate of 1e30 makes a member's loss non-finite (exit 1): the population goes on,
    that member copies the other's checkpoint at the round's end and finishes."""
    result = launch(
        tmp_path,
        "--name",
        "x",
        "--grid",
        "learning-rate=1e-3,1e30",
        "--pbt-interval",
        2048,
        "--parallel",
        2,
        budget=4096,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (first,) = rounds(tmp_path / "x")
    crashed = {m["name"]: m for m in first["members"]}["learning-rate=1e30__seed1"]
    assert crashed["state"] == "failed" and crashed["objective"] is None, first
    assert crashed["copies"] == "learning-rate=1e-3__seed1"
    assert "non-finite" in (tmp_path / "x" / "learning-rate=1e30__seed1" / "log.txt").read_text()
    record = json.loads((tmp_path / "x" / "sweep.json").read_text())
    assert [r["state"] for r in record["runs"]] == ["done", "done"]


def test_the_slurm_job_runs_the_population(tmp_path):
    """--slurm --pbt writes one job that runs the launcher's rounds in its allocation: run here
    with bash, it trains the population."""
    result = launch(
        tmp_path, "--name", "s", "--seeds", 1, 2, "--pbt-interval", 2048, "--slurm", budget=4096
    )
    assert result.returncode == 0, result.stdout + result.stderr
    script = tmp_path / "s" / "pbt.sbatch"
    text = script.read_text()
    assert "#SBATCH --job-name=s" in text and "--slurm" not in text and "--pbt" in text
    run = subprocess.run(
        ["bash", str(script)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert [r["step"] for r in rounds(tmp_path / "s")] == [2048]


@pytest.mark.slow
def test_a_population_rescues_a_bad_learning_rate_grid(tmp_path):
    """APPO on CartPole from learning rates 1e-5, 3e-5, 3e-2, 1e-1 (the preset's is 1e-3), 100k
    steps a member, evaluated every 10k: alone, only the 3e-2 run ends at 475 or more (seed 1 at
    --actor-lag 0, last evaluations 36, 114, 500, 360; at the default lag, docs/results.md's plain
    sweeps, 1 of 4 on seeds 1-3). As a population ranked by evaluation every round of 20k steps,
    the bottom members copy a better one's checkpoint, and every member ended at 500.

    --actor-lag 0, the synchronous limit: the update that acts is fixed, so the population takes
    the same course however loaded the machine is (at the default lag, the suite's load once
    turned this run into docs/results.md's seed-3 failure: no copy of the 3e-2 member)."""
    result = launch(
        tmp_path,
        "--name",
        "r",
        "--grid",
        "learning-rate=1e-5,3e-5,3e-2,1e-1",
        "--pbt-interval",
        20000,
        "--parallel",
        2,
        "--pbt-seed",
        1,
        budget=100000,
        common=["--env-id", "CartPole-v1", "--eval-interval", 10000, "--actor-lag", 0],
    )
    assert result.returncode == 0, result.stdout + result.stderr
    logged = rounds(tmp_path / "r")
    assert sum(1 for r in logged for m in r["members"] if m["copies"]) >= 2
    assert all(r["objective"] == "eval/episodic_return" for r in logged)
    last = {}
    for member in (tmp_path / "r").glob("*__seed1"):
        records = (member / "metrics.jsonl").read_text().splitlines()
        values = [json.loads(line) for line in records]
        evaluations = [r for r in values if r["tag"] == "eval/episodic_return"]
        assert evaluations[-1]["step"] >= 90000, evaluations[-1]
        last[member.name.split("__")[0]] = evaluations[-1]["value"]
    assert sum(value >= 475 for value in last.values()) >= 3, last


def test_the_objective_is_the_members_own_last_evaluation(tmp_path):
    """At a round's end a member has paused at its first update past the boundary: its objective
    is the evaluation logged there (after the boundary's step), not one from the round before;
    without evaluations, the mean of its last 100 training games up to its step."""
    launch_module = load_script(str(REPO_ROOT / "utils" / "launch.py"))
    lines = [(10240, "eval/episodic_return", 100.0), (20224, "eval/episodic_return", 200.0)]
    lines += [(30000, "eval/episodic_return", 300.0)]
    lines += [(s, "charts/episodic_return", float(s)) for s in range(1, 301)]
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "wall_time": 1.0, "tag": t, "value": v}) + "\n"
            for s, t, v in lines
        )
    )
    assert launch_module.objective(str(tmp_path / "m"), 20224) == (200.0, "eval/episodic_return")
    assert launch_module.objective(str(tmp_path / "m"), 250) == (
        200.5,
        "charts/episodic_return, last 100",
    )
