"""One learner update on a fixed global batch, for tests/test_scale.py, which runs this file in
subprocesses with XLA_FLAGS=--xla_force_host_platform_device_count=N:

    python tests/scale_worker.py SCRIPT OUT.npz IDS [IDS ...] [--split] [--distributed ADDRESS PROCESSES ID]

IDS is a comma-separated list of learner device ids ("0,1"); one update runs for each, from the
same state on the same batch of 8 envs x 8 CartPole-v1 steps, and OUT.npz gets the parameters
after each update (key "0,1": the flattened leaves). With --distributed, this process joins the
others (jax.distributed, gloo) and passes its share of the batch's envs (process p: envs p x 8/P
to (p+1) x 8/P - 1); process 0 writes OUT.npz.

With --split (one process, at least 2 devices), the same process then compiles the update for
learner devices 0 and 1 on a batch of 8 envs x 12 steps, feed-forward and with --lstm, and prints
for each a line "FF|LSTM ROWS [rows of the first hidden layer's matmuls] ALL-REDUCES n": the
test that the update is split over the devices, in the process that checked its numbers (one
start of Python and JAX instead of two).
"""

import dataclasses
import re
import sys

import jax
import numpy as np

from helpers import load_script
from jax_async_rl import devices

T, B = 8, 8


def global_batch(sync: bool, T: int = T) -> dict:
    """A fixed rollout of B envs x T steps: CartPole-shaped observations, episode ends, a time
    limit."""
    rng = np.random.default_rng(0)
    dones = (rng.uniform(size=(T, B)) < 0.1).astype(np.float32)
    rollout = {
        "obs": rng.normal(size=(T, B, 4)).astype(np.float32),
        "actions": rng.integers(0, 2, size=(T, B)).astype(np.int32),
        "logprobs": np.log(rng.uniform(0.3, 0.7, size=(T, B))).astype(np.float32),
        "rewards": rng.normal(size=(T, B)).astype(np.float32),
        "dones": dones,
        "truncated": dones * (rng.uniform(size=(T, B)) < 0.5),
        "valid": np.concatenate([np.ones((1, B)), 1.0 - dones[:-1]]).astype(np.float32),
        "policy_version": np.zeros((T, B), np.int32),
        "bootstrap_obs": rng.normal(size=(B, 4)).astype(np.float32),
    }
    if sync:
        rollout["values"] = rng.normal(size=(T, B)).astype(np.float32)
    return rollout


def split_rows(module, script):
    """The --split report: print, feed-forward and with --lstm, the row counts of the first hidden
    layer's matmuls and the number of all-reduces of the update compiled for learner devices 0, 1
    on a batch of 8 envs x 12 steps (96 rows: 48 a device)."""
    for lstm in (False, True):
        flags = dict(
            env_id="CartPole-v1",
            num_envs=B,
            num_steps=12,
            total_timesteps=9600,
            learner_device_ids=[0, 1],
            lstm=lstm,
        )
        if "num_splits" in {f.name for f in dataclasses.fields(module.Args)}:
            flags["num_splits"] = 1
        args = module.resolve_args(module.Args(**flags))
        _, mesh = devices.make_mesh(args)
        network, optimizer, continuous, _, state = module.build(args, jax.random.PRNGKey(0))
        state = dict(devices.replicated(mesh, state), global_step=0)
        update = module.make_update(network, optimizer, args, continuous, mesh)
        batch = global_batch("sync" in script, T=12)
        if lstm:
            batch.update(state=module.zero_core(args.lstm_size, B)[0], first=batch["valid"] * 0)
        rollout = devices.to_learner(mesh, batch)
        lowered = update.lower(state, rollout, jax.random.PRNGKey(1), args.total_timesteps)
        text = lowered.compile().as_text()
        rows = sorted({int(n) for n in re.findall(r"= f32\[(\d+),64\]\{[^}]*\} dot\(", text)})
        print("LSTM" if lstm else "FF", "ROWS", rows, "ALL-REDUCES", text.count("all-reduce("))


def main(argv):
    script, out, *rest = argv
    split = "--split" in rest
    rest = [a for a in rest if a != "--split"]
    launch = {}
    if "--distributed" in rest:
        at = rest.index("--distributed")
        address, processes, process_id = rest[at + 1 : at + 4]
        launch = dict(
            distributed=True,
            coordinator_address=address,
            num_processes=int(processes),
            process_id=int(process_id),
        )
        rest = rest[:at]
    module = load_script(script)
    num_processes = launch.get("num_processes", 1)
    flags = dict(
        env_id="CartPole-v1",
        num_envs=B // num_processes,
        num_steps=T,
        total_timesteps=100 * T * B,
        **launch,
    )
    if "num_splits" in {f.name for f in dataclasses.fields(module.Args)}:
        flags["num_splits"] = 1
    devices.start_processes(module.Args(**flags))
    results = {}
    for ids in rest:
        args = module.resolve_args(
            module.Args(**flags, learner_device_ids=[int(i) for i in ids.split(",")])
        )
        _, mesh = devices.make_mesh(args)
        network, optimizer, continuous, _, state = module.build(args, jax.random.PRNGKey(0))
        state = dict(
            state,
            params=devices.replicated(mesh, state["params"]),
            opt_state=devices.replicated(mesh, state["opt_state"]),
        )
        share = B // num_processes
        envs = slice(jax.process_index() * share, (jax.process_index() + 1) * share)
        local = jax.tree_util.tree_map_with_path(
            lambda path, x: x[envs] if devices.env_axis(path) == 0 else x[:, envs],
            global_batch("sync" in script),
        )
        update = module.make_update(network, optimizer, args, continuous, mesh)
        new_state, diagnostics = update(
            state, devices.to_learner(mesh, local), jax.random.PRNGKey(1), args.total_timesteps
        )
        assert bool(jax.device_get(diagnostics["finite"]))
        leaves = jax.tree.leaves(jax.device_get(new_state["params"]))
        results[ids] = np.concatenate([np.ravel(x) for x in leaves])
    if jax.process_index() == 0:
        np.savez(out, **results)
    if split:
        split_rows(module, script)


if __name__ == "__main__":
    main(sys.argv[1:])
