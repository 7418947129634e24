"""A memory task for your own-environment path: a corridor whose end asks what its start showed.

At the first step the agent sees a cue (left or right); it then walks `length` cells of a
corridor that shows nothing of the cue; at the end it must turn the way the cue said: +1 if it
does, -1 if not (Bakker's T-maze, 2002). Each step costs 0.01; turning before the end, or
failing to reach it within 4 x length steps, ends the game with -1. A feed-forward policy can
only guess at the end (about 0 on average); one with memory (--lstm) reaches about
1 - 0.01 x length.

    python appo_envpool.py --env-id examples.corridor:Corridor --env-kwargs '{"length": 4}' --lstm
    python appo_envpool.py --env-id Corridor-v0 --env-module examples.corridor
    python utils/benchmark.py --env-id examples.corridor:Corridor --env-kwargs '{"step_seconds":
    0.001}' \
        --parts sampler --quick --num-envs 16      # a 1 ms step: 2 splits against 1
"""

import time

import gymnasium
import numpy as np


class Corridor(gymnasium.Env):
    metadata = {"render_modes": ["rgb_array"], "render_fps": 4}
    # observation: [cue says left, cue says right, at the end]; actions: forward, turn left, turn
    # right
    observation_space = gymnasium.spaces.Box(0.0, 1.0, (3,), np.float32)
    action_space = gymnasium.spaces.Discrete(3)

    def __init__(self, length: int = 4, step_seconds: float = 0.0, render_mode=None):
        if length < 1:
            raise ValueError(f"length must be at least 1, got {length}")
        self.length, self.step_seconds, self.render_mode = length, step_seconds, render_mode
        self.position, self.cue, self.t = 0, 0, 0

    def observe(self):
        obs = np.zeros(3, np.float32)
        if self.t == 0:
            obs[self.cue] = 1.0
        obs[2] = float(self.position == self.length)
        return obs

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        if self.step_seconds:  # a slow simulator is slow to reset too
            time.sleep(self.step_seconds)
        self.position, self.cue, self.t = 0, int(self.np_random.integers(2)), 0
        return self.observe(), {}

    def step(self, action):
        if self.step_seconds:  # a slow simulator: what double buffering hides (utils/benchmark.py)
            time.sleep(self.step_seconds)
        self.t += 1
        action = int(action)
        if action == 0:
            self.position = min(self.position + 1, self.length)
            reward, terminated = -0.01, False
        elif self.position == self.length:
            reward, terminated = (1.0 if action - 1 == self.cue else -1.0), True
        else:
            reward, terminated = -1.0, True  # turned into a wall
        truncated = not terminated and self.t >= 4 * self.length
        return self.observe(), reward, terminated, truncated, {}

    def render(self):
        frame = np.full((16, 16 * (self.length + 1), 3), 255, np.uint8)
        frame[4:12, 16 * self.position + 4 : 16 * self.position + 12] = (0, 0, 255)
        if self.t == 0:
            frame[:4, :16] = (255, 0, 0) if self.cue == 0 else (0, 255, 0)
        return frame


gymnasium.register("Corridor-v0", entry_point=Corridor)
