"""What 2 splits could give on CartPole without the actor's Python, and what they give with the
plainest Python loop.

Steps envpool's CartPole-v1 (8 envs, one env thread) with a small MLP policy (64-64, as the
scripts' vector network), with 1 split (batch 8) and with 2 splits (batch 4), in two ways:
- one jitted `lax.fori_loop` over envpool's XLA interface (`envs.xla()`: recv, policy, a scatter
  into a rollout buffer by env id, send), so no Python runs per step;
- the plainest Python loop (recv, one jitted policy call, send), none of the actor's bookkeeping.
Each in two layouts: "pinned", the sampler benchmark's (envpool's thread on the first core, this
loop and XLA, single-threaded, on the others), and "unpinned" (the OS schedules both).
Run: `python docs/benchmark/actor/xla_loop.py` (about a minute).
"""

import os
import subprocess
import sys
import time

NUM_ENVS, T, ITERS = 8, 64, 20000


def measure(layout):
    """In this (fresh) process: print a line per loop kind for `layout`."""
    cores = sorted(os.sched_getaffinity(0))
    pin = {}
    if layout == "pinned":
        os.sched_setaffinity(0, cores[1:])  # this thread and XLA's; envpool's thread takes cores[0]
        pin = {"thread_affinity_offset": cores[0]}
    import envpool
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.tanh(nn.Dense(64)(x))
            x = nn.tanh(nn.Dense(64)(x))
            return nn.Dense(2)(x)

    def make(batch):
        envs = envpool.make(
            "CartPole-v1",
            env_type="gymnasium",
            num_envs=NUM_ENVS,
            batch_size=batch,
            num_threads=1,
            **pin,
        )
        envs.async_reset()
        return envs, MLP(), MLP().init(jax.random.PRNGKey(0), jnp.zeros((1, 4)))

    def xla_loop(batch):
        envs, net, params = make(batch)
        handle, recv, send, _ = envs.xla()

        def body(_, carry):
            handle, key, buffer, steps = carry
            handle, (obs, _, _, _, info) = recv(handle)
            env_id = info["env_id"]
            key, subkey = jax.random.split(key)
            action = jax.random.categorical(subkey, net.apply(params, obs))
            buffer = buffer.at[steps[env_id] % T, env_id].set(obs)
            return (
                send(handle, action.astype(jnp.int32), env_id),
                key,
                buffer,
                steps.at[env_id].add(1),
            )

        loop = jax.jit(lambda *carry: jax.lax.fori_loop(0, ITERS, body, carry))
        carry = (
            handle,
            jax.random.PRNGKey(1),
            jnp.zeros((T, NUM_ENVS, 4)),
            jnp.zeros(NUM_ENVS, jnp.int32),
        )
        carry = jax.block_until_ready(loop(*carry))
        start = time.perf_counter()
        jax.block_until_ready(loop(*carry))
        return (time.perf_counter() - start) / (ITERS * batch)

    def python_loop(batch):
        envs, net, params = make(batch)

        @jax.jit
        def policy(params, obs, key):
            key, subkey = jax.random.split(key)
            return jax.random.categorical(subkey, net.apply(params, obs)), key

        key = jax.random.PRNGKey(1)
        for n in range(ITERS // 4 + 200):
            if n == 200:
                start = time.perf_counter()
            obs, _, _, _, info = envs.recv()
            action, key = policy(params, obs, key)
            envs.send(np.asarray(action), info["env_id"])
        return (time.perf_counter() - start) / (ITERS // 4 * batch)

    for name, fn in [("one XLA loop", xla_loop), ("Python loop", python_loop)]:
        one, two = fn(NUM_ENVS), fn(NUM_ENVS // 2)
        print(
            f"{layout}, {name}: 1 split {one * 1e6:.2f} µs per env step, 2 splits {two * 1e6:.2f}: "
            f"2 splits / 1 split = {one / two:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    if len(sys.argv) > 1:
        measure(sys.argv[1])
    else:  # each layout in a fresh process: affinity and XLA flags must not leak
        for layout in ["pinned", "unpinned"] * 2:
            env = (
                dict(os.environ, XLA_FLAGS="--xla_cpu_multi_thread_eigen=false")
                if layout == "pinned"
                else None
            )
            subprocess.run([sys.executable, "-W", "ignore", __file__, layout], check=True, env=env)
