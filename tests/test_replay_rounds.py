"""The replay families' rounds (the loops of dqn_envpool.py; sac_envpool.py and td3_envpool.py
hold the same text, tests/test_scripts.py), tested once through dqn_envpool.py: a
thread's error stops the run within seconds, and a signal stops it within seconds in either mode,
in the middle of a long round and with an env that never answers. (The buffer: test_replay.py;
each script's math, rounds and learning: test_dqn.py, test_qpg.py.)"""

import signal
import time

import pytest
from helpers import (
    count_complete_lines,
    fail_on_call,
    load_script,
    read_checkpoint,
    run_main,
    sigterm_when,
)

SCRIPT = "dqn_envpool.py"
TINY = [
    "--env-id",
    "CartPole-v1",
    "--num-envs",
    "4",
    "--num-steps",
    "16",
    "--learning-starts",
    "64",
    "--buffer-size",
    "1000",
    "--batch-size",
    "32",
    "--replay-ratio",
    "2.0",
    "--eval-episodes",
    "0",
    "--log-frequency",
    "1",
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where, serial", [("actor", False), ("learner", False), ("learner", True)])
def test_a_thread_error_stops_the_run_within_seconds(where, serial, tmp_path, capsys, monkeypatch):
    """The actor's 4th chunk, or the learner's 4th round, raises: the run exits 1 within seconds
    with the traceback, naming the thread."""
    module = load_script(SCRIPT)
    function = "collect" if where == "actor" else "learn_round"
    failed_at = fail_on_call(monkeypatch, module, function, 4, f"injected {where} fault")
    code, _, err = run_main(
        SCRIPT,
        [
            *TINY,
            "--run-dir",
            tmp_path / "r",
            "--total-timesteps",
            64 * 1000,
            *(["--serial"] if serial else []),
        ],
        capsys,
    )
    assert code == 1 and f"RuntimeError: injected {where} fault" in err and "in faulty" in err, err[
        -3000:
    ]
    assert f"error in the {'training loop' if serial else where} thread" in err
    assert time.monotonic() - failed_at[0] < 20


@pytest.mark.timeout(300)
@pytest.mark.parametrize("serial", [False, True])
def test_a_signal_stops_a_long_round_within_seconds_with_a_checkpoint(serial, tmp_path):
    """Rounds of 8,000 gradient steps on batches of 256 (15 s each here, alone): SIGTERM once the
    first round (filling the buffer) is logged, in the middle of the second, stops the run within
    10 s, exit 143, with the first round's checkpoint."""
    run = tmp_path / "r"
    argv = [
        *TINY,
        "--run-dir",
        run,
        "--total-timesteps",
        64 * 50,
        "--batch-size",
        "256",
        "--replay-ratio",
        "32000",
        *(["--serial"] if serial else []),
    ]
    code, seconds, err = sigterm_when(
        SCRIPT,
        argv,
        tmp_path / "logs",
        lambda: count_complete_lines(run / "metrics.jsonl", '"replay/fill"') >= 1,
        240,
    )
    assert code == 128 + signal.SIGTERM and seconds < 10 and "Traceback" not in err, (
        seconds,
        err[-3000:],
    )
    assert int(read_checkpoint(run)["state"]["global_step"]) == 64


@pytest.mark.timeout(300)
@pytest.mark.parametrize("serial", [False, True])
def test_a_signal_stops_a_run_whose_env_never_answers(serial, tmp_path):
    """A user's env that hangs in `step` in the second round: SIGTERM stops the run within 10 s
    with its checkpoint, in either mode."""
    run = tmp_path / "r"
    argv = [
        *TINY,
        "--env-id",
        "tests.user_envs:Faulty",
        "--env-kwargs",
        '{"at": 20, "how": "hang"}',
        "--run-dir",
        run,
        "--total-timesteps",
        64 * 50,
        "--num-threads",
        "2",
        *(["--serial"] if serial else []),
    ]
    code, seconds, err = sigterm_when(
        SCRIPT,
        argv,
        tmp_path / "logs",
        lambda: count_complete_lines(run / "metrics.jsonl", '"replay/fill"') >= 1,
        240,
    )
    assert code == 128 + signal.SIGTERM and seconds < 10 and "Traceback" not in err, (
        seconds,
        err[-3000:],
    )
    assert int(read_checkpoint(run)["state"]["global_step"]) == 64
