"""Time the pixel network alone: the Nature CNN of the PPO scripts on Atari frames (84 x 84 x 4 ->
conv 32 8x8/4 -> 64 4x4/2 -> 64 3x3/1 -> 512 -> policy and value heads), its forward pass at the
actor's batch and one Adam step of a PPO-shaped loss at the learner's minibatch.

    python utils/network_speed.py --conv matmul     # JAX, the convolutions as matmuls (CPU default)
    python utils/network_speed.py --conv native     # JAX, lax.conv_general_dilated
    python utils/network_speed.py --conv torch      # the same network in torch (torch installed)

JAX runs ppo_sync_baseline.py's own network and optimiser (its `build` for Pong-v5); torch runs
the same layers with torch.optim.Adam. Prints one JSON line: the median milliseconds of a forward
pass and of a train step over --seconds each, after a warm-up call. utils/benchmark.py --parts
network runs the three side by side.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ACTIONS = 6  # Pong's


def median_ms(call, seconds: float) -> float:
    """The median wall time of `call()` over `seconds` (at least 5 calls), after one warm-up."""
    call()
    times, start = [], time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < seconds:
        begin = time.perf_counter()
        call()
        times.append(time.perf_counter() - begin)
    return 1000 * statistics.median(times)


def batch(rng, size: int):
    """Random frames, actions, advantages and returns of `size` samples (numpy)."""
    import numpy as np

    return (
        rng.integers(0, 256, size=(size, 4, 84, 84), dtype=np.uint8),
        rng.integers(0, ACTIONS, size=size),
        rng.standard_normal(size).astype(np.float32),
        rng.standard_normal(size).astype(np.float32),
    )


def jax_times(conv: str, forward_batch: int, train_batch: int, seconds: float) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jax_async_rl import checkpoints, convolution

    convolution.use(conv)
    script = checkpoints.load_script(
        Path(__file__).resolve().parent.parent / "ppo_sync_baseline.py"
    )
    args = script.resolve_args(script.Args(env_id="Pong-v5"))
    network, optimizer, _, _, state = script.build(args, jax.random.PRNGKey(0))

    def loss(params, frames, actions, advantages, returns):
        logits, value, _ = network.apply(params, frames)
        log_probs = jax.nn.log_softmax(logits)
        chosen = jnp.take_along_axis(log_probs, actions[:, None], axis=-1)[:, 0]
        entropy = -(jnp.exp(log_probs) * log_probs).sum(-1)
        return (-chosen * advantages + 0.5 * (value - returns) ** 2 - 0.01 * entropy).mean()

    @jax.jit
    def train_step(params, opt_state, *data):
        grads = jax.grad(loss)(params, *data)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    forward = jax.jit(lambda params, frames: network.apply(params, frames))
    rng = np.random.default_rng(0)
    frames = jnp.asarray(batch(rng, forward_batch)[0])
    data = [jnp.asarray(x) for x in batch(rng, train_batch)]
    params, opt_state = state["params"], state["opt_state"]

    def step():
        nonlocal params, opt_state
        params, opt_state = train_step(params, opt_state, *data)
        jax.block_until_ready(params)

    return dict(
        forward_ms=median_ms(lambda: jax.block_until_ready(forward(params, frames)), seconds),
        train_ms=median_ms(step, seconds),
        backend=jax.default_backend(),
    )


def torch_times(forward_batch: int, train_batch: int, seconds: float) -> dict:
    import numpy as np
    import torch
    from torch import nn

    torso = nn.Sequential(
        nn.Conv2d(4, 32, 8, 4),
        nn.ReLU(),
        nn.Conv2d(32, 64, 4, 2),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, 1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3136, 512),
        nn.ReLU(),
    )
    policy, value = nn.Linear(512, ACTIONS), nn.Linear(512, 1)
    parameters = [*torso.parameters(), *policy.parameters(), *value.parameters()]
    optimizer = torch.optim.Adam(parameters, lr=2.5e-4, eps=1e-5)

    def apply(frames):
        hidden = torso(frames.float() / 255.0)
        return policy(hidden), value(hidden)[:, 0]

    rng = np.random.default_rng(0)
    frames = torch.from_numpy(batch(rng, forward_batch)[0])
    data = [torch.from_numpy(x) for x in batch(rng, train_batch)]

    def forward():
        with torch.no_grad():
            apply(frames)

    def step():
        train_frames, actions, advantages, returns = data
        logits, values = apply(train_frames)
        log_probs = torch.log_softmax(logits, -1)
        chosen = log_probs.gather(1, actions[:, None])[:, 0]
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        loss = (-chosen * advantages + 0.5 * (values - returns) ** 2 - 0.01 * entropy).mean()
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(parameters, 0.5)
        optimizer.step()

    return dict(
        forward_ms=median_ms(forward, seconds),
        train_ms=median_ms(step, seconds),
        backend=f"torch {torch.__version__}, {torch.get_num_threads()} threads",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conv", choices=("matmul", "native", "torch"), default="matmul")
    parser.add_argument("--forward-batch", type=int, default=32, help="the actor's batch")
    parser.add_argument("--train-batch", type=int, default=256, help="the learner's minibatch")
    parser.add_argument("--seconds", type=float, default=10.0, help="timing, each of the two")
    args = parser.parse_args()
    if args.conv == "torch":
        result = torch_times(args.forward_batch, args.train_batch, args.seconds)
    else:
        result = jax_times(args.conv, args.forward_batch, args.train_batch, args.seconds)
    print(json.dumps(dict(vars(args), **result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
