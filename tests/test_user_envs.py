"""A user's Gymnasium env through the scripts (--env-id module:callable, --env-module,
--env-kwargs): bad input in one line, Dict observations, evaluation and video, resume; an env
that raises or a worker the OS kills stops the run with exit 1 and leaves no worker; the XLA
script refuses; and the example memory env learns (feed-forward guesses, --lstm remembers)."""

import json
import signal
import time

import numpy as np
import pytest
from conftest import LIBRARY_HOST

from helpers import (
    REPO_ROOT,
    cli,
    gone_within,
    load_script,
    read_checkpoint,
    read_metrics,
    run_main,
    run_script,
    start_script,
    tag_values,
    wait_until,
)

HOST = LIBRARY_HOST
CORRIDOR = "examples.corridor:Corridor"


@pytest.fixture(autouse=True)
def at_the_root(monkeypatch):
    """Users run the scripts from the folder their env module is in: here, the repository root."""
    monkeypatch.chdir(REPO_ROOT)


BAD = {
    "no-module": (dict(env_id="no_such_module:Env"), ["--env-id no_such_module", "cannot import"]),
    "no-callable": (dict(env_id="examples.corridor:Nope"), ["has no 'Nope'"]),
    "not-registered": (
        dict(env_id="Nope-v0", env_module="examples.corridor"),
        ["not registered", "Corridor-v0"],
    ),
    "bad-json": (dict(env_id=CORRIDOR, env_kwargs="{length: 2}"), ["--env-kwargs", "not JSON"]),
    "not-an-object": (
        dict(env_id=CORRIDOR, env_kwargs="[2]"),
        ["--env-kwargs", "not a JSON object"],
    ),
    "unknown-kwarg": (
        dict(env_id=CORRIDOR, env_kwargs='{"lengthx": 2}'),
        ["does not take them", "lengthx"],
    ),
    "kwargs-for-envpool": (dict(env_kwargs='{"a": 1}'), ["--env-kwargs is for a Gymnasium env"]),
    "space-mismatch": (dict(env_id="tests.user_envs:WrongSpace"), ["shape (3,)", "says (2,)"]),
    "first-reset-raises": (
        dict(env_id="tests.user_envs:Bad", env_kwargs='{"kind": "reset"}'),
        [
            "--env-id tests.user_envs:Bad",
            "first reset() raised ValueError: the simulator is not installed",
            "user_envs.py",
        ],
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_user_env_input_is_one_line(case, tmp_path, capsys):
    flags, fragments = BAD[case]
    code, _, err = run_main(HOST, cli(HOST, run_dir=tmp_path / "run", **flags), capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(f in lines[0] for f in fragments), lines[0]
    assert not (tmp_path / "run").exists()


def test_the_xla_actor_refuses_a_gymnasium_env(tmp_path, capsys):
    code, _, err = run_main(
        "appo_envpool_xla.py",
        cli("appo_envpool_xla.py", env_id=CORRIDOR, run_dir=tmp_path / "r"),
        capsys,
    )
    assert code == 2 and "no XLA interface" in err and "appo_envpool.py" in err, err


@pytest.mark.timeout(300)
def test_dict_observations_evaluation_video_and_resume(tmp_path, capsys):
    """A function that returns an env with Dict observations and Box actions trains with APPO (2
    splits), evaluates, and resumes; the corridor's video is written at its own frame rate."""
    run_dir = tmp_path / "dict"
    argv = cli(
        "appo_envpool.py",
        env_id="tests.user_envs:dict_env",
        env_kwargs='{"length": 4}',
        run_dir=run_dir,
        eval_episodes=2,
        num_splits=2,
    )
    code, out, err = run_main("appo_envpool.py", argv, capsys)
    assert code == 0 and "eval: 2 episodes" in out, err
    step = int(read_checkpoint(run_dir)["state"]["global_step"])
    evaluate = load_script(
        REPO_ROOT / "utils" / "evaluate.py"
    )  # rebuilds the user's env from the config
    assert (
        evaluate.main(evaluate.EvalArgs(run=str(run_dir), episodes=2, trust_env_module=True)) == 0
    )
    assert json.loads((run_dir / "eval.json").read_text())["episodes"] == 2
    # The env's module named again: it is the user's choice, not the folder's.
    argv = [
        "--resume",
        run_dir,
        "--total-timesteps",
        3 * step,
        "--env-id",
        "tests.user_envs:dict_env",
    ]
    assert run_main("appo_envpool.py", argv) == 0
    assert int(read_checkpoint(run_dir)["state"]["global_step"]) == 3 * step
    video_run = tmp_path / "video"
    code, _, err = run_main(
        HOST,
        cli(
            HOST,
            env_id="Corridor-v0",
            env_module="examples.corridor",
            eval_episodes=2,
            capture_video=True,
            run_dir=video_run,
        ),
        capsys,
    )
    assert code == 0, err
    import imageio

    videos = list((video_run / "videos").glob("*.mp4"))
    assert len(videos) == 1 and imageio.get_reader(videos[0]).get_meta_data()["fps"] == 4


# kind -> what the line must say (env 0 goes wrong first: the envs step in turn in their worker)
WRONG = {
    "reward": "env 0 returned a non-finite reward (nan) at step 6 of its episode",
    "observation": "env 0 returned a non-finite observation (inf) at step 6 of its episode",
    "shape": "env 0 returned an observation of shape (3,) float32 at step 6 of its episode, where "
    "its first had (2,) float32",
    "dtype": "env 0 returned an observation of shape (2,) float64 at step 6 of its episode, where "
    "its first had (2,) float32",
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", list(WRONG))
def test_what_an_env_returns_wrong_is_named(kind, tmp_path, capsys):
    """A NaN reward, an inf observation, an observation of another shape or dtype mid-episode:
    the run stops (exit 1) with one line naming the env id and what the env returned, not a
    non-finite loss nor a traceback from the network."""
    argv = cli(
        HOST,
        env_id="tests.user_envs:Bad",
        env_kwargs=json.dumps({"kind": kind}),
        run_dir=tmp_path / "r",
        total_timesteps=4096,
        num_threads=1,
    )
    code, _, err = run_main(HOST, argv, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert "--env-id tests.user_envs:Bad: " + WRONG[kind] in lines[0], lines[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "script, how", [("appo_envpool.py", "raise"), ("ppo_sync_baseline.py", "kill")]
)
def test_a_failing_user_env_stops_the_run_and_leaves_no_worker(script, how, tmp_path):
    """The env raises (or its worker is SIGKILLed) at its 40th step: exit 1 within 30 s, the env's
    traceback (or the dead worker) named with its env id, and every worker process gone."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    kwargs = json.dumps({"pid_dir": str(pid_dir), "at": 40, "how": how})
    result = run_script(
        script,
        cli(
            script,
            env_id="tests.user_envs:Faulty",
            env_kwargs=kwargs,
            run_dir=tmp_path / "r",
            total_timesteps=10**6,
        ),
        timeout=120,
    )
    ended = time.time()
    assert result.returncode == 1, result.stderr[-3000:]
    faults = [float(p.read_text()) for p in pid_dir.glob("fault-*")]
    assert faults and ended - min(faults) < 30, (ended - min(faults), result.stderr[-3000:])
    if how == "raise":
        assert (
            "raised in its worker" in result.stderr
            and "ValueError: injected failure in the user's env" in result.stderr
        )
    else:
        assert "died (exit code -9)" in result.stderr, result.stderr[-3000:]
    pids = [int(p.name) for p in pid_dir.iterdir() if p.name.isdigit()]
    assert pids, "no worker wrote its pid"
    assert gone_within(pids, 10) == [], "worker processes left behind"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "script, end",
    [(HOST, "SIGTERM"), (HOST, "SIGKILL"), (HOST, "env-timeout"), ("appo_envpool.py", "SIGTERM")],
)  # the sync loop, an actor thread
def test_no_process_outlives_a_run_whose_env_hangs(script, end, tmp_path):
    """An env that starts a process of its own (a simulator) and then hangs in step(): however the
    run ends (SIGTERM, SIGKILL of the training process, or --env-timeout, which names the env and
    the call in one line), its workers and the processes its envs started are gone within 10 s."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    argv = cli(
        script,
        env_id="tests.user_envs:Stuck",
        env_kwargs=json.dumps({"pid_dir": str(pid_dir), "at": 30}),
        run_dir=tmp_path / "run",
        total_timesteps=10**6,
    )
    proc = start_script(
        script, [*argv, *(["--env-timeout", 8] if end == "env-timeout" else [])], tmp_path / "logs"
    )
    try:
        wait_until(lambda: (pid_dir / "hung").exists(), proc, 200)
        if end != "env-timeout":
            proc.send_signal(getattr(signal, end))
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = (tmp_path / "logs" / "stderr.txt").read_text()
    pids = [int(p.name) for p in pid_dir.iterdir() if p.name.isdigit()]
    assert len(pids) >= 4, (
        pids
    )  # the workers (2) and their envs' children (4), the probes made in the run's process
    assert gone_within(pids, 10) == [], f"processes left behind; stderr:\n{err[-3000:]}"
    imported = {pid: (pid_dir / str(pid)).read_text() for pid in pids if pid != proc.pid}
    assert not any(imported.values()), (
        imported
    )  # a worker imports the env, not JAX nor the training script
    if end == "env-timeout":
        lines = [line for line in err.splitlines() if line.startswith("error")]
        assert code == 1 and "Traceback" not in err, err[-3000:]
        assert (
            "tests.user_envs:Stuck" in lines[0]
            and "step()" in lines[0]
            and "--env-timeout 8" in lines[0]
        ), err
    else:
        assert code in (128 + getattr(signal, end), -signal.SIGKILL), (code, err[-3000:])


@pytest.mark.timeout(300)
def test_sigterm_checkpoints_and_the_run_resumes(tmp_path):
    run_dir = tmp_path / "run"
    argv = cli(
        "appo_envpool.py", env_id=CORRIDOR, run_dir=run_dir, total_timesteps=10**6, save_interval=0
    )
    proc = start_script("appo_envpool.py", argv, tmp_path / "logs")
    try:
        wait_until(
            lambda: (
                (run_dir / "metrics.jsonl").exists()
                and '"losses/' in (run_dir / "metrics.jsonl").read_text()
            ),
            proc,
            200,
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    step = int(read_checkpoint(run_dir)["state"]["global_step"])
    result = run_script(
        "appo_envpool.py",
        [
            "--resume",
            run_dir,
            "--total-timesteps",
            step + 2048,
            "--eval-episodes",
            0,
            "--trust-env-module",
        ],
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(read_checkpoint(run_dir)["state"]["global_step"]) > step


# The example memory env, at default flags (the classic preset): measured on this machine,
# seed 1 (docs/results.md). Feed-forward can only guess at the end: about 0 (the env's property,
# checked once, with the sync baseline).
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "script, lstm", [("ppo_sync_baseline.py", False), ("appo_envpool.py", True)]
)  # sync --lstm: 0.96 too (docs/results.md)
def test_the_example_memory_env_learns(script, lstm, tmp_path):
    run_dir = tmp_path / "run"
    argv = [
        "--env-id",
        CORRIDOR,
        "--env-kwargs",
        '{"length": 4}',
        "--total-timesteps",
        100_000,
        "--run-dir",
        run_dir,
        "--eval-episodes",
        0,
        *(["--num-splits", 2] if script == "appo_envpool.py" else []),
        *(["--lstm"] if lstm else []),
    ]
    result = run_script(script, argv, timeout=800)
    assert result.returncode == 0, result.stderr[-2000:]
    returns = tag_values(read_metrics(run_dir), "charts/episodic_return")
    final = float(np.mean(returns[-100:]))
    if lstm:
        assert final > 0.8, final  # remembers the cue: 1 - 0.04 at best
    else:
        assert -0.3 < final < 0.3, (
            final
        )  # walks to the end and guesses (a random policy: about -0.9)


@pytest.mark.timeout(300)
def test_the_normaliser_and_two_actor_threads_with_a_user_env(tmp_path, capsys):
    """--norm-obs, --norm-reward and 2 actor threads (each its own pool of 2 splits) on a user's
    env: the run trains, and the normaliser counted every observation the actors saw."""
    run_dir = tmp_path / "run"
    argv = cli(
        "appo_envpool.py",
        env_id=CORRIDOR,
        run_dir=run_dir,
        norm_obs="True",
        norm_reward="True",
        num_actor_threads=2,
        num_splits=2,
    )
    code, _, err = run_main("appo_envpool.py", argv, capsys)
    assert code == 0, err
    state = read_checkpoint(run_dir)["state"]
    assert float(np.asarray(state["norm"]["obs_count"])) >= int(state["global_step"]) > 0
    config = json.loads((run_dir / "config.json").read_text())
    assert config["num_actor_threads"] == 2 and config["norm_obs"] is True
