"""jax_async_rl.gym_pool: a user's Gymnasium envs behind envpool's interface, against the same
envs stepped directly with envpool's autoreset rule; out-of-order splits; Dict observations; an
env that raises and a worker that dies reported with the env's id, no worker left behind; a hung
env named, and no process (worker, guard, what an env started) outliving its pool or the process
that made it, however that ends."""

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import gymnasium
import numpy as np
import pytest
from helpers import gone_within, live
from user_envs import Stuck

from jax_async_rl.gym_pool import EnvError, GymPool, Stopped


class Counter(gymnasium.Env):
    """Observation: [steps so far, last action]; reward: the action; episodes of `length` steps
    (`length` from the seed, so envs differ); raises at step `fail_at` if set."""

    observation_space = gymnasium.spaces.Box(0, 1000, (2,), np.float32)
    action_space = gymnasium.spaces.Discrete(3)

    def __init__(self, fail_at=None, dict_obs=False):
        self.fail_at, self.dict_obs, self.t, self.length, self.total = fail_at, dict_obs, 0, 5, 0
        if dict_obs:
            self.observation_space = gymnasium.spaces.Dict(
                {"count": Counter.observation_space, "flag": gymnasium.spaces.Discrete(2)}
            )

    def obs(self, action):
        o = np.array([self.t, action], np.float32)
        return {"count": o, "flag": self.t % 2} if self.dict_obs else o

    def reset(self, seed=None, options=None):
        if seed is not None:
            self.length = 3 + seed % 4
        self.t = 0
        return self.obs(0), {}

    def step(self, action):
        self.t += 1
        self.total += 1
        if self.fail_at is not None and self.total >= self.fail_at:
            raise ValueError("injected failure in the user's env")
        return self.obs(action), float(action), self.t >= self.length, False, {}


class Make:
    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def __call__(self):
        return Counter(**self.kwargs)


def reference(num_envs, seed, steps_actions):
    """The same envs stepped here, with envpool's rule: the step after an end resets."""
    envs = [Counter() for _ in range(num_envs)]
    obs = [env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]
    done, elapsed, out = [False] * num_envs, [0] * num_envs, []
    for env_ids, actions in steps_actions:
        rows = []
        for i, a in zip(env_ids, actions):
            if done[i]:
                o, r, term = envs[i].reset()[0], 0.0, False
                elapsed[i] = 0
            else:
                o, r, term, _, _ = envs[i].step(a)
                elapsed[i] += 1
            done[i] = term
            rows.append((o, r, term, elapsed[i]))
        out.append(rows)
    return obs, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "processes", [1, 4]
)  # a process a split (its envs in turn), a process an env
def test_the_pool_steps_as_envpool_does_with_splits_out_of_order(processes):
    pool = GymPool(Make(), num_envs=4, batch_size=2, seed=10, processes=processes)
    assert len(pool.procs) == max(2, processes)
    rng = np.random.default_rng(0)
    try:
        pool.async_reset()
        first = {}
        for _ in range(2):
            obs, _, _, _, info = pool.recv()
            first[int(info["env_id"][0])] = obs
        ref_obs, _ = reference(4, 10, [])
        assert np.array_equal(np.concatenate([first[0], first[2]]), np.stack(ref_obs))
        sent = []
        for _ in range(30):
            split = int(rng.integers(2))  # send the splits in any order, one at a time
            ids = np.arange(2 * split, 2 * split + 2)
            actions = rng.integers(0, 3, 2)
            pool.send(actions, ids)
            obs, reward, term, trunc, info = pool.recv()
            assert list(info["env_id"]) == list(ids)
            sent.append((list(ids), list(actions), obs, reward, term, info["elapsed_step"]))
        _, ref = reference(4, 10, [(ids, actions) for ids, actions, *_ in sent])
        for (_, _, obs, reward, term, elapsed), rows in zip(sent, ref):
            assert np.array_equal(obs, np.stack([r[0] for r in rows]))
            assert list(reward) == [r[1] for r in rows] and list(term) == [r[2] for r in rows]
            assert list(elapsed) == [r[3] for r in rows]
        assert any(any(row[2] for row in rows) for rows in ref), (
            "no episode ended: the autoreset is untested"
        )
    finally:
        pool.close()
    assert all(proc.poll() is not None for proc in pool.procs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("processes", [1, 2])  # 2: envs 0 and 1-2, put together again
def test_dict_observations_and_the_synchronous_step(processes):
    pool = GymPool(Make(dict_obs=True), num_envs=3, batch_size=3, seed=0, processes=processes)
    try:
        obs, _ = pool.reset()
        assert set(obs) == {"count", "flag"} and obs["count"].shape == (3, 2)
        obs, reward, term, trunc, info = pool.step(np.array([1, 2, 0]))
        assert list(reward) == [1.0, 2.0, 0.0] and list(obs["count"][:, 1]) == [1, 2, 0]
        assert list(info["env_id"]) == [0, 1, 2] and list(info["elapsed_step"]) == [1, 1, 1]
    finally:
        pool.close()


@pytest.mark.timeout(120)
def test_an_env_that_raises_is_reported_with_its_id_and_traceback():
    pool = GymPool(Make(fail_at=3), num_envs=2, batch_size=1, seed=0)
    try:
        pool.async_reset()
        for _ in range(2):
            pool.recv()
        with pytest.raises(
            EnvError, match=r"env 1 raised in its worker (.|\n)*ValueError: injected failure"
        ):
            for _ in range(5):
                pool.send([1], [1])
                pool.recv()
    finally:
        pool.close()
    assert all(proc.poll() is not None for proc in pool.procs)


@pytest.mark.timeout(120)
def test_a_worker_killed_by_the_os_is_reported():
    """4 envs in 2 splits, 2 processes each: the second process of split 1 (env 3) is killed."""
    pool = GymPool(Make(), num_envs=4, batch_size=2, seed=0, processes=4)
    try:
        pool.async_reset()
        for _ in range(2):
            pool.recv()
        os.kill(pool.procs[3].pid, signal.SIGKILL)
        pool.procs[3].wait(5)
        pool.send([1, 1], [2, 3])
        with pytest.raises(EnvError, match=r"the worker of env 3 died \(exit code -9\)"):
            pool.recv()
    finally:
        pool.close()


def pids_in(pid_dir) -> list:
    """The pids Stuck envs wrote (workers and the processes they started), but this process's
    (the pool's probe env, closed at once)."""
    return [
        int(p.name)
        for p in Path(pid_dir).iterdir()
        if p.name.isdigit() and int(p.name) != os.getpid()
    ]


@pytest.mark.timeout(120)
def test_a_hung_env_is_named_and_close_kills_it_and_what_it_started(tmp_path):
    """Env 0 hangs in its second step: a wait with a timeout gives up (TimeoutError), the run's
    stop ends the wait (gym_pool.Stopped), --env-timeout names the env and the call; close()
    then leaves no worker, no process an env started, no guard."""
    stop = threading.Event()
    pool = GymPool(
        functools.partial(Stuck, str(tmp_path), 2),
        num_envs=2,
        batch_size=1,
        seed=0,
        processes=2,
        timeout=10,
        stop=stop,
    )
    try:
        pool.async_reset()
        pool.recv()
        pool.recv()
        pool.send([0], [0])
        pool.recv()
        pool.send([0], [0])  # env 0's second step: it hangs
        with pytest.raises(TimeoutError):
            pool.recv(timeout=0.5)
        stop.set()
        with pytest.raises(Stopped):
            pool.recv()
        stop.clear()
        with pytest.raises(
            EnvError, match=r"^env 0 did not answer step\(\) within --env-timeout 10 s"
        ):
            pool.recv()
        pids = pids_in(tmp_path)
        assert len(live(pids)) == 4, pids  # 2 workers, the 2 sleeps their envs started
    finally:
        pool.close()
    # close() waits for its own children; the sleeps (the workers' children) die of the group's
    # SIGKILL as the kernel gets to them: on a loaded machine a moment later (seen on CI).
    assert gone_within([*pids, pool.guard.pid], 10) == []


PARENT = """
import functools, os, sys, time
sys.path.insert(0, {tests!r})
from user_envs import Stuck
from jax_async_rl.gym_pool import GymPool
pool = GymPool(functools.partial(Stuck, {pid_dir!r}, 2), num_envs=2, batch_size=1, seed=0, processes=2)
pool.async_reset(); pool.recv(); pool.recv()
pool.send([0], [0]); pool.recv(); pool.send([0], [0])
open({ready!r}, "w").close()
while not os.path.exists({go!r}):  # the test counts the live processes first
    time.sleep(0.05)
{end}
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("end", ["SIGKILL", "exception"])
def test_no_process_outlives_the_process_that_made_the_pool(end, tmp_path):
    """A process makes a pool whose env 0 hangs in a step and whose envs each started a process,
    then is SIGKILLed (nothing of it runs again) or ends by an exception without closing the
    pool: every worker, every process the envs started and the guard are gone within 10 s."""
    pid_dir, ready, go = tmp_path / "pids", tmp_path / "ready", tmp_path / "go"
    pid_dir.mkdir()
    code = PARENT.format(
        tests=str(Path(__file__).parent),
        pid_dir=str(pid_dir),
        ready=str(ready),
        go=str(go),
        end="time.sleep(1000)" if end == "SIGKILL" else "raise RuntimeError('the run crashed')",
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and parent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), parent.stderr.read() if parent.poll() is not None else "not ready"
        pids = [pid for pid in pids_in(pid_dir) if pid != parent.pid]
        assert len(live(pids)) == 4, pids
        go.touch()
        if end == "SIGKILL":
            parent.kill()
        parent.wait(30)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert gone_within(pids, 10) == [], "processes outlived the process that made the pool"
