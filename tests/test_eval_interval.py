"""--eval-interval: evaluation during training (rlpyt's offline evaluation) in every script.

The points sit at the env steps of the parameters evaluated, one per multiple of the interval that
an update crosses, the final evaluation last; a --deterministic run scores the same twice; a resume
neither repeats nor skips a point, whether the stop came between evaluations or with some pending
in the asynchronous evaluator (held in the checkpoint); the evaluation policy is the script's
(DQN's near-greedy, SAC's mean action), not the training one.
"""

import collections
import shutil

import numpy as np
import pytest
from helpers import (
    describe,
    load_script,
    read_checkpoint,
    read_metrics,
    run_main,
    run_script,
    sigterm_when,
    tag_steps,
    tag_values,
)

EVAL_TAGS = (
    "eval/episodic_return",
    "eval/episodic_return_std",
    "eval/episodes",
    "eval/seconds",
    "eval/update",
)


def expected_steps(batch: int, updates: int, interval: int, start_update: int = 0) -> list:
    """The steps of the updates after which the points fall: each update that crosses a multiple
    of `interval` (the last excepted), then the last (the final evaluation)."""
    steps = [
        (u + 1) * batch
        for u in range(start_update, updates - 1)
        if (u + 1) * batch // interval > u * batch // interval
    ]
    return steps + [updates * batch]


def evaluations(run_dir) -> dict:
    """{tag: [(step, value), ...]} of the eval/* records, in the order of metrics.jsonl."""
    found = collections.defaultdict(list)
    for record in read_metrics(run_dir):
        if record["tag"].startswith("eval/"):
            found[record["tag"]].append((record["step"], record["value"]))
    return found


def test_appo_evaluates_at_each_interval_with_the_parameters_of_that_step(tmp_path):
    """APPO on CartPole (256 env steps an update): a point at each update that crosses a multiple
    of 2,000 steps, logged at that update's step with its number, every tag once per point; the
    final evaluation is the last point, at the last update; stdout says each."""
    run_dir = tmp_path / "run"
    result = run_script(
        "appo_envpool.py",
        ["--env-id", "CartPole-v1", "--total-timesteps", 8192, "--eval-interval", 2000]
        + ["--run-dir", run_dir],
        timeout=300,
    )
    assert result.returncode == 0, describe(result)
    found = evaluations(run_dir)
    steps = expected_steps(256, 32, 2000)
    assert steps == [2048, 4096, 6144, 8192]
    for tag in EVAL_TAGS:
        assert [step for step, _ in found[tag]] == steps, (tag, found[tag])
    assert [value for _, value in found["eval/update"]] == [step / 256 for step in steps]
    assert all(value == 10 for _, value in found["eval/episodes"])
    assert all(0 < value < 60 for _, value in found["eval/seconds"])
    for step, update in zip(steps[:-1], (8, 16, 24)):
        assert f"eval at step {step} (update {update}): 10 episodes, return" in result.stdout
    assert "eval: 10 episodes, return" in result.stdout

    # utils/plot.py draws these points as logged, and tabulates the last beside the training return
    plot = load_script("utils/plot.py")
    run = plot.read_run(str(run_dir), plot.EVAL_TAG)
    assert run.curve[0].tolist() == steps
    assert run.curve[2].tolist() == [value for _, value in found["eval/episodic_return"]]
    assert run.last_eval == found["eval/episodic_return"][-1][1]
    out = tmp_path / "plots"
    result = run_script("utils/plot.py", [run_dir, "--tag", plot.EVAL_TAG, "--out", out])
    assert result.returncode == 0, describe(result)
    assert (out / "CartPole-v1.png").stat().st_size > 0
    assert f"| {run.last_eval:.2f} ± 0.00 |" in (out / "summary.md").read_text()
    result = run_script("utils/plot.py", [run_dir, "--tag", "eval/nothing", "--out", out])
    assert result.returncode == 2 and "--tag eval/nothing" in result.stderr, describe(result)


def test_eval_interval_needs_episodes():
    result = run_script(
        "ppo_sync_baseline.py",
        ["--env-id", "CartPole-v1", "--eval-interval", 1000, "--eval-episodes", 0],
    )
    assert result.returncode == 2 and "--eval-interval 1000" in result.stderr, describe(result)
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("script", ["ppo_sync_baseline.py", "appo_envpool.py"])
def test_deterministic_runs_score_the_same_and_a_resume_neither_repeats_nor_skips(script, tmp_path):
    """--deterministic twice: the same points, the same scores. Stopped by SIGTERM mid-run and
    resumed: the same points once each, with the uninterrupted run's scores (an evaluation a signal
    cut off is pending in the checkpoint, and played on resume).

    The second run with the seed is the stopped one: its points up to the signal and the resume's
    after it must score as the uninterrupted run's, so a score that a run does not reproduce fails
    here as it would between two whole runs (which this test ran before, a third run of the same
    budget)."""
    argv = ["--env-id", "CartPole-v1", "--deterministic", "--eval-interval", 1500]
    argv += ["--total-timesteps", 16384, "--eval-episodes", 20, "--save-interval", 4]
    result = run_script(script, argv + ["--run-dir", tmp_path / "a"], timeout=300)
    assert result.returncode == 0, describe(result)
    runs = [evaluations(tmp_path / "a")]
    steps = expected_steps(256, 64, 1500)  # both presets' CartPole: 8 envs x 32 steps
    assert [step for step, _ in runs[0]["eval/episodic_return"]] == steps

    stopped = tmp_path / "stopped"

    def past_second_point():
        path = stopped / "metrics.jsonl"
        return path.exists() and path.read_text().count('"eval/episodic_return"') >= 2

    code, _, stderr = sigterm_when(
        script, argv + ["--run-dir", stopped], tmp_path / "logs", past_second_point, 240
    )
    assert code == 143, stderr[-3000:]
    result = run_script(script, ["--resume", stopped], timeout=300)
    assert result.returncode == 0, describe(result)
    resumed = evaluations(stopped)
    for tag in ("eval/episodic_return", "eval/update"):
        assert sorted(resumed[tag]) == runs[0][tag], tag


def test_appo_resume_plays_the_evaluations_its_evaluator_left_pending(tmp_path):
    """APPO's evaluator thread falls behind (200 games an evaluation as CartPole is learned): at
    SIGTERM the checkpoint holds the evaluations not logged yet; the resume plays them first, and
    every point is logged once: none repeated, none skipped."""
    run_dir = tmp_path / "run"
    argv = ["--env-id", "CartPole-v1", "--total-timesteps", 40960, "--eval-interval", 1024]
    argv += ["--eval-episodes", 200, "--save-interval", 5, "--run-dir", run_dir]

    def pending_in_checkpoint():
        try:
            return "evaluations" in read_checkpoint(run_dir)["state"]
        except Exception:
            return False

    code, _, stderr = sigterm_when(
        "appo_envpool.py", argv, tmp_path / "logs", pending_in_checkpoint, 240
    )
    assert code == 143, stderr[-3000:]
    pending = read_checkpoint(run_dir)["state"].get("evaluations")
    assert pending is not None and len(pending["steps"]) >= 1
    logged = set(tag_steps(read_metrics(run_dir), "eval/episodic_return"))
    result = run_script(
        "appo_envpool.py", ["--resume", run_dir, "--eval-episodes", 10], timeout=300
    )
    assert result.returncode == 0, describe(result)
    records = read_metrics(run_dir)
    steps = tag_steps(records, "eval/episodic_return")
    assert sorted(steps) == expected_steps(256, 160, 1024), steps
    first = [int(s) for s in np.asarray(pending["steps"]) if int(s) not in logged]
    assert first and result.stdout.index(f"eval at step {first[0]} ") < result.stdout.index(
        "eval: playing"
    )
    assert len(tag_values(records, "eval/update")) == len(steps)


DQN_BUDGET = ["--total-timesteps", 6000, "--learning-starts", 1000, "--eval-interval", 2000]
# SAC's check (3 points, none a training return) does not depend on the budget: a quarter of DQN's
# (the gradient steps of --serial SAC were most of this test's time; 3,000 steps took 37 s alone,
# these 28 s).
SAC_BUDGET = ["--total-timesteps", 1500, "--learning-starts", 500, "--eval-interval", 500]


@pytest.mark.parametrize(
    "script, argv",
    [
        ("dqn_envpool.py", ["--env-id", "CartPole-v1", "--serial", *DQN_BUDGET]),
        ("dqn_envpool.py", ["--env-id", "CartPole-v1", *DQN_BUDGET]),
        ("sac_envpool.py", ["--env-id", "Pendulum-v1", "--serial", *SAC_BUDGET]),
    ],
)
def test_replay_scripts_evaluate_with_their_evaluation_policy(script, argv, tmp_path):
    """DQN (ε 1.0 throughout training, near-greedy in evaluation) and SAC (sampled in training,
    its mean action in evaluation): the evaluation curve is its own, not the training returns."""
    run_dir = tmp_path / "run"
    extra = ["--start-e", 1.0, "--end-e", 1.0] if script == "dqn_envpool.py" else []
    result = run_script(script, argv + extra + ["--run-dir", run_dir], timeout=300)
    assert result.returncode == 0, describe(result)
    records = read_metrics(run_dir)
    evaluated = tag_values(records, "eval/episodic_return")
    trained = tag_values(records, "charts/episodic_return")
    assert len(evaluated) == 3, evaluated  # 2 during training, the final one
    assert not set(evaluated) & set(trained)
    if script == "dqn_envpool.py":  # random play's CartPole lasts ~22 steps; ε 0.001 play not
        assert abs(np.mean(trained) - 22) < 6 and all(
            abs(v - np.mean(trained)) > 5 for v in evaluated
        )


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory):
    """A finished sync CartPole run with --eval-interval (its checkpoint to craft): its folder."""
    run_dir = tmp_path_factory.mktemp("evaluated") / "run"
    argv = ["--env-id", "CartPole-v1", "--total-timesteps", 2048, "--eval-interval", 512]
    assert run_main("ppo_sync_baseline.py", argv + ["--run-dir", run_dir]) == 0
    return run_dir


@pytest.mark.parametrize(
    "evaluations, fragment",
    [
        (5, "malformed"),
        ({"steps": np.array([1.5])}, "malformed"),
        ("steps", "malformed"),
        ("past", "not those of the run's updates"),
        ("negative", "not those of the run's updates"),
    ],
)
def test_a_crafted_pending_evaluation_is_one_line_before_the_folder_changes(
    evaluations, fragment, evaluated_run, tmp_path, capfd
):
    """A checkpoint whose pending evaluations are not what a run writes (not a record, float
    steps, a step past the checkpoint's or below 1): --resume says so in one line, exit 2, and
    leaves config.json and the folder's files as they were. The resume runs in this process (as
    its command line: helpers.run_main), its stderr read at the file descriptor (capfd)."""
    import flax.serialization

    run_dir = tmp_path / "run"
    shutil.copytree(evaluated_run, run_dir)
    path = run_dir / "checkpoint.msgpack"
    payload = flax.serialization.msgpack_restore(path.read_bytes())
    state = payload["state"]
    one = {"params": jax_tree_stack(state["params"]), "norm": {}}
    if evaluations == "past":
        evaluations = dict(one, steps=np.array([4096]), updates=np.array([8]))
    elif evaluations == "negative":
        evaluations = dict(one, steps=np.array([-5]), updates=np.array([1]))
    elif evaluations == "steps":
        evaluations = dict(one, steps=np.array([512]))
    state["evaluations"] = evaluations
    path.write_bytes(flax.serialization.msgpack_serialize(payload))
    before = sorted(p.name for p in run_dir.iterdir()), (run_dir / "config.json").read_text()
    capfd.readouterr()
    code, out, err = run_main(
        "ppo_sync_baseline.py", ["--resume", run_dir, "--total-timesteps", 4096], capfd
    )
    assert code == 2 and fragment in err, (code, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert (
        sorted(p.name for p in run_dir.iterdir()),
        (run_dir / "config.json").read_text(),
    ) == before


def jax_tree_stack(tree):
    """A params tree (nested dicts of arrays) with a leading axis of 1: one pending evaluation."""
    if isinstance(tree, dict):
        return {k: jax_tree_stack(v) for k, v in tree.items()}
    return np.asarray(tree)[None]
