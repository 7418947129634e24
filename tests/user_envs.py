"""Gymnasium envs for tests/test_user_envs.py, imported by name (`tests.user_envs:...`) in the
training scripts' worker processes."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import gymnasium
import numpy as np


class Faulty(gymnasium.Env):
    """A short-episode env that writes its pid under `pid_dir`, then at its `at`-th step raises
    (how="raise"), SIGKILLs its own process (how="kill") or never returns (how="hang")."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gymnasium.spaces.Discrete(2)

    def __init__(self, pid_dir: str = "", at: int = 10**9, how: str = "raise"):
        self.at, self.how, self.steps, self.t, self.pid_dir = at, how, 0, 0, pid_dir
        if pid_dir:
            Path(pid_dir, str(os.getpid())).touch()

    def reset(self, seed=None, options=None):
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.steps, self.t = self.steps + 1, self.t + 1
        if self.steps >= self.at:
            if self.pid_dir:  # when the fault happened, for the test's 30 s bound
                Path(self.pid_dir, f"fault-{os.getpid()}").write_text(repr(time.time()))
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            while self.how == "hang":
                time.sleep(60)
            raise ValueError("injected failure in the user's env")
        return np.full(2, 0.5, np.float32), float(action), self.t >= 5, False, {}


class Stuck(gymnasium.Env):
    """An env that starts a process of its own (`sleep`, as a simulator would) and writes its
    process's and that child's pids under `pid_dir` (its process's file names what heavy was
    imported there: `jax`, the training script); at its `at`-th step it hangs for good (writing
    `hung` first)."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gymnasium.spaces.Discrete(2)

    def __init__(self, pid_dir: str = "", at: int = 10**9):
        self.at, self.steps, self.pid_dir = at, 0, pid_dir
        self.child = subprocess.Popen(["sleep", "1000"])
        Path(pid_dir, str(self.child.pid)).touch()
        script = os.path.basename(
            getattr(sys.modules.get("__mp_main__"), "__file__", None) or ""
        )  # spawn's re-import
        Path(pid_dir, str(os.getpid())).write_text(
            " ".join(["jax"] * ("jax" in sys.modules) + [script] * bool(script))
        )

    def reset(self, seed=None, options=None):
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.steps += 1
        if self.steps >= self.at:
            Path(self.pid_dir, "hung").touch()
            time.sleep(10**6)
        return np.zeros(2, np.float32), 1.0, self.steps % 5 == 0, False, {}

    def close(self):
        self.child.kill()
        self.child.wait()


class Bad(gymnasium.Env):
    """An env that goes wrong as `kind` says: its first reset raises ("reset"), or from its `at`-th
    step on it returns a NaN reward ("reward"), an inf in its observation ("observation"), an
    observation of another shape ("shape") or dtype ("dtype")."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gymnasium.spaces.Discrete(2)

    def __init__(self, kind: str = "", at: int = 20):
        self.kind, self.at, self.steps = kind, at, 0

    def reset(self, seed=None, options=None):
        if self.kind == "reset":
            raise ValueError("the simulator is not installed")
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.steps += 1
        obs, reward, bad = np.zeros(2, np.float32), 1.0, self.steps >= self.at
        if bad and self.kind == "reward":
            reward = float("nan")
        elif bad and self.kind == "observation":
            obs[1] = np.inf
        elif bad and self.kind == "shape":
            obs = np.zeros(3, np.float32)
        elif bad and self.kind == "dtype":
            obs = obs.astype(np.float64)
        return obs, reward, self.steps % 7 == 0, False, {}


def dict_env(length: int = 3):
    """A function that returns an env (the other form of module:callable), with Dict
    observations."""
    return DictEnv(length)


class DictEnv(gymnasium.Env):
    observation_space = gymnasium.spaces.Dict(
        {
            "position": gymnasium.spaces.Box(0.0, 10.0, (1,), np.float32),
            "goal": gymnasium.spaces.Discrete(2),
        }
    )
    action_space = gymnasium.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def __init__(self, length):
        self.length, self.t = length, 0

    def reset(self, seed=None, options=None):
        self.t = 0
        return {"position": np.zeros(1, np.float32), "goal": 1}, {}

    def step(self, action):
        self.t += 1
        obs = {"position": np.array([self.t], np.float32), "goal": 1}
        return obs, -float(np.abs(action).sum()), False, self.t >= self.length, {}


class WrongSpace(Faulty):
    """Says Box(2,) and returns 3 numbers."""

    def reset(self, seed=None, options=None):
        return np.zeros(3, np.float32), {}


class Chain(gymnasium.Env):
    """A chain of `cells` for dqn_envpool.py's end-to-end test: start at cell 0; action 1 steps
    right, 0 left (cell 0 is a wall); reaching the last cell pays 1 and ends the game; `limit`
    steps truncate it. Observations one-hot. The optimal values, truncations bootstrapped:
    Q*(s, right) = γ^(cells - 2 - s), Q*(s, left) = γ Q*(max(s - 1, 0), right)."""

    action_space = gymnasium.spaces.Discrete(2)

    def __init__(self, cells: int = 5, limit: int = 10):
        self.cells, self.limit = cells, limit
        self.observation_space = gymnasium.spaces.Box(0.0, 1.0, (cells,), np.float32)
        self.position = self.t = 0

    def reset(self, seed=None, options=None):
        self.position = self.t = 0
        return np.eye(self.cells, dtype=np.float32)[0], {}

    def step(self, action):
        self.t += 1
        self.position = (
            min(self.position + 1, self.cells - 1) if action == 1 else max(self.position - 1, 0)
        )
        done = self.position == self.cells - 1
        return (
            np.eye(self.cells, dtype=np.float32)[self.position],
            float(done),
            done,
            self.t >= self.limit and not done,
            {},
        )


class LegalMoves(gymnasium.Env):
    """Legal actions in the observation (tests/test_action_masks.py): each step, a random target
    among `actions`, and `legal` of them legal, the target among them. The target pays 1, another
    legal action 0; an illegal action ends the game with `penalty`, or with `strict` raises (a run
    that takes one fails). Games of `length` steps. Observations: the target, the mask (MultiBinary,
    as Jumanji's int8). A policy that knows the mask but not the target scores length / legal."""

    def __init__(
        self,
        actions: int = 8,
        legal: int = 3,
        length: int = 16,
        penalty: float = -1.0,
        strict: bool = False,
    ):
        self.actions, self.legal, self.length, self.penalty, self.strict = (
            actions,
            legal,
            length,
            penalty,
            strict,
        )
        self.action_space = gymnasium.spaces.Discrete(actions)
        self.observation_space = gymnasium.spaces.Dict(
            {
                "target": gymnasium.spaces.Discrete(actions),
                "action_mask": gymnasium.spaces.MultiBinary(actions),
            }
        )
        self.t = 0

    def draw(self):
        self.target = int(self.np_random.integers(self.actions))
        others = self.np_random.permutation(np.delete(np.arange(self.actions), self.target))[
            : self.legal - 1
        ]
        self.mask = np.zeros(self.actions, np.int8)
        self.mask[[self.target, *others]] = 1
        return {"target": self.target, "action_mask": self.mask.copy()}

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.draw(), {}

    def step(self, action):
        self.t += 1
        if not self.mask[action]:
            if self.strict:
                raise ValueError(
                    f"illegal action {action}: legal {np.flatnonzero(self.mask).tolist()}"
                )
            return self.draw(), self.penalty, True, False, {}
        reward = float(action == self.target)
        return self.draw(), reward, False, self.t >= self.length, {}


class FloatMask(LegalMoves):
    """LegalMoves with its mask as floats (tests/test_action_masks.py: refused at start-up)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.observation_space = gymnasium.spaces.Dict(
            {
                "target": gymnasium.spaces.Discrete(self.actions),
                "action_mask": gymnasium.spaces.Box(0.0, 1.0, (self.actions,), np.float32),
            }
        )

    def draw(self):
        return dict(super().draw(), action_mask=self.mask.astype(np.float32))
