"""Randomness keyed by env and step (--deterministic): what an env's actions draw depends on the
run's key, the env's index over all actor threads and processes, and its own step count, never
on which batch or split it was stepped in, nor when.

`env_keys` makes one threefry key per env step inside a jitted function (a hash of the three
numbers, the same arithmetic in numpy and jax.numpy); `EnvStreams` gives host-side uniforms for
samplers that draw on the host (DQN's ε-greedy), in blocks of each env's own stream.
"""

import numpy as np

BLOCK = 256  # steps of an env's stream drawn at once (EnvStreams)


def mix(h, xp):
    """MurmurHash3's 32-bit finaliser: every input bit reaches every output bit (uint32,
    wrapping)."""
    h = h ^ (h >> 16)
    h = h * xp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * xp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def env_keys(key, env_ids, steps, xp):
    """Threefry keys [B, 2] (uint32) for envs `env_ids` [B] at their steps `steps` [B], from the
    run's `key` (uint32 [2]): distinct for every (env, step), and the same whichever envs share a
    batch. `xp`: numpy, or jax.numpy inside a jitted function."""
    key = xp.asarray(key).astype(xp.uint32)
    e = mix(xp.asarray(env_ids).astype(xp.uint32) * xp.uint32(0x9E3779B9) ^ key[0], xp)
    a = mix(e ^ mix(xp.asarray(steps).astype(xp.uint32) ^ key[1], xp), xp)
    return xp.stack([a, mix(a ^ xp.uint32(0x68E31DA4), xp)], -1)


class EnvStreams:
    """Uniforms [B, width] in [0, 1) for envs at their steps, each env's from a stream of its own
    (numpy's PCG64 seeded by (seed, env, block)): `uniform(env_ids, steps)` for envs `first_env`
    to `first_env + num_envs - 1`. Each env's current block of BLOCK steps is drawn once, so a draw
    costs an index; an env moves to its next block as its steps reach it."""

    def __init__(self, seed: int, first_env: int, num_envs: int, width: int):
        self.seed, self.first = seed, first_env
        self.numbers = np.full(num_envs, -1)  # the block each env holds
        self.draws = np.zeros((num_envs, BLOCK, width))

    def uniform(self, env_ids, steps):
        """[B, width]: row i is env env_ids[i]'s draw at its step steps[i] (a step in or after the
        env's current block: each env steps forward)."""
        rows = np.asarray(env_ids, np.int64) - self.first
        steps = np.asarray(steps, np.int64)
        for row in rows[self.numbers[rows] != steps // BLOCK]:
            self.numbers[row] = steps[rows == row][0] // BLOCK
            env = self.first + int(row)
            seq = np.random.SeedSequence([self.seed, env, int(self.numbers[row])])
            generator = np.random.Generator(np.random.PCG64(seq))
            self.draws[row] = generator.random(self.draws.shape[1:])
        return self.draws[rows, steps % BLOCK]
