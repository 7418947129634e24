"""Why --num-splits defaults to 1 on vector tasks: double buffering cannot pay on CartPole, even
with no Python in the loop.

Times envpool's CartPole-v1, 8 envs, one env thread, stepped by a small MLP policy (64-64, as the
scripts' vector network) in two ways, with 1 split (batch 8) and 2 splits (batch 4):
- one jitted `lax.fori_loop` over envpool's XLA interface (`envs.xla()`: recv, policy, a scatter
  into a rollout buffer by env id, send), so no Python runs per step;
- the plainest Python loop (recv, one jitted policy call, send), with none of the actor's
  bookkeeping.
Run: `taskset -c 1 python docs/benchmark/actor/xla_loop.py` (envpool's thread then shares core 1
with XLA; unpinned, the ratios are the same).
"""

import time

import envpool
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

NUM_ENVS, T, ITERS = 8, 64, 2000


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(64)(x))
        x = nn.tanh(nn.Dense(64)(x))
        return nn.Dense(2)(x)


def make(batch):
    envs = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=NUM_ENVS, batch_size=batch, num_threads=1)
    envs.async_reset()
    net = MLP()
    return envs, net, net.init(jax.random.PRNGKey(0), jnp.zeros((1, 4)))


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
        return send(handle, action.astype(jnp.int32), env_id), key, buffer, steps.at[env_id].add(1)

    loop = jax.jit(lambda *carry: jax.lax.fori_loop(0, ITERS, body, carry))
    carry = jax.block_until_ready(loop(handle, jax.random.PRNGKey(1), jnp.zeros((T, NUM_ENVS, 4)), jnp.zeros(NUM_ENVS, jnp.int32)))
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
    for n in range(ITERS + 200):
        if n == 200:
            start = time.perf_counter()
        obs, _, _, _, info = envs.recv()
        action, key = policy(params, obs, key)
        envs.send(np.asarray(action), info["env_id"])
    return (time.perf_counter() - start) / (ITERS * batch)


if __name__ == "__main__":
    for name, fn in [("one XLA loop", xla_loop), ("Python loop", python_loop)]:
        one, two = fn(NUM_ENVS), fn(NUM_ENVS // 2)
        print(f"{name}: 1 split {one * 1e6:.2f} µs per env step, 2 splits {two * 1e6:.2f}: "
              f"2 splits / 1 split = {one / two:.2f}x")
