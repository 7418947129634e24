"""Devices and processes: joining a run of many processes, the actor devices and the learner's
mesh, moving rollouts and parameters between them, and the collectives that keep the processes
in lockstep. With one device and one process every function here is the plain case.

Actor devices run inference; learner devices hold replicated parameters and take each update's
batch split along the env axis ("env"): `jit` with `NamedSharding` partitions the update and
all-reduces the gradients.
"""

import dataclasses
import hashlib
import json
import os
import re

import jax
import numpy as np
from jax.experimental import multihost_utils

from jax_async_rl.flags import UsageError


def start_processes(args):
    """--distributed: join the run's other processes (jax.distributed), before anything uses a
    device. The coordinator's address, the process count and this process's id come from the
    flags, or else from the cluster (SLURM, Open MPI, ...). A process that dies stops the others:
    the collective the others wait in fails at once (its sockets close), and they say which
    process stopped answering and exit 1 (`peer_failure`, runs.report_errors). Where no collective
    fails (a machine that vanished) or process 0 dies (it holds JAX's coordination service), the
    service's heartbeats end the others within 30 s by an abort in C++ (SIGABRT, "the JAX
    distributed service detected fatal errors"), before Python can say more."""
    given = [
        f"--{name.replace('_', '-')}"
        for name, unset in [("coordinator_address", ""), ("num_processes", 0), ("process_id", -1)]
        if getattr(args, name) != unset
    ]
    if not args.distributed:
        if given:
            raise UsageError(f"{given[0]} is for a run of many processes: pass --distributed too")
        return
    if args.num_processes < 0:
        raise UsageError(f"--num-processes must be >= 0 (0: detected), got {args.num_processes}")
    if args.process_id < -1 or (
        args.num_processes and not -1 < args.process_id < args.num_processes
    ):
        raise UsageError(
            f"--process-id {args.process_id} must be in 0 to --num-processes - 1 "
            f"({args.num_processes - 1})"
        )
    if (args.num_processes or args.process_id >= 0) and not args.coordinator_address:
        raise UsageError(
            "--num-processes and --process-id need --coordinator-address HOST:PORT (process 0's)"
        )
    # collectives between CPU processes
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # it would take SIGTERM from the run's signal handler
    jax.config.update("jax_enable_preemption_service", False)
    try:
        jax.distributed.initialize(
            args.coordinator_address or None,
            args.num_processes or None,
            None if args.process_id < 0 else args.process_id,
            # The others wait at exit for process 0's evaluation
            heartbeat_timeout_seconds=30,
            shutdown_timeout_seconds=3600,
        )
    except ValueError as e:  # no cluster detected, and no --coordinator-address
        raise UsageError(
            f"--distributed: {e} Pass --coordinator-address, --num-processes and --process-id, "
            "or launch under a cluster manager JAX detects (SLURM, Open MPI, ...)"
        )


def actor_threads(args) -> int:
    """This process's actor threads: actor devices x --num-actor-threads (a script without that
    flag has one)."""
    return len(args.actor_device_ids) * getattr(args, "num_actor_threads", 1)


def available_memory():
    """Bytes of memory this machine can give a new allocation without swapping (Linux's
    MemAvailable); None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            return next(
                int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")
            )
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def local_envs(args) -> int:
    """The envs of this process's actor threads, which make its share of every update's batch."""
    return actor_threads(args) * args.num_envs


def global_envs(args) -> int:
    return jax.process_count() * local_envs(args)


def describe_batch(args) -> str:
    """An update's batch, in words: processes x actor threads (where a script has them) x
    num_envs x num_steps."""
    threads, processes = actor_threads(args), jax.process_count()
    actors = (
        f"{threads} actor thread{'s' * (threads > 1)} x "
        if hasattr(args, "num_actor_threads")
        else ""
    )
    return (
        f"{processes} process{'es' * (processes > 1)} x {actors}{args.num_envs} envs x "
        f"{args.num_steps} steps "
        f"= {global_envs(args) * args.num_steps} env steps"
    )


def make_mesh(args):
    """(actor devices, the learner's mesh). The device ids index this process's devices; the mesh
    lines up the learner devices of every process along one axis, "env", over which each update's
    batch is split (jit with NamedSharding: XLA partitions the update and all-reduces gradients)."""
    local = [d for d in jax.devices() if d.process_index == jax.process_index()]
    for flag, ids in [
        ("--actor-device-ids", args.actor_device_ids),
        ("--learner-device-ids", args.learner_device_ids),
    ]:
        if not ids or min(ids) < 0 or max(ids) >= len(local) or len(set(ids)) < len(ids):
            raise UsageError(
                f"{flag} {' '.join(map(str, ids))}: this process has {len(local)} "
                f"{jax.default_backend()} "
                f"devices, 0 to {len(local) - 1}; give each at most once"
            )
    if local_envs(args) % len(args.learner_device_ids):
        raise UsageError(
            f"the {local_envs(args)} envs of this process do not divide over its "
            f"{len(args.learner_device_ids)} learner devices (--learner-device-ids)"
        )
    learners = [
        d
        for p in range(jax.process_count())
        for d in np.array([d for d in jax.devices() if d.process_index == p])[
            args.learner_device_ids
        ]
    ]
    return [local[i] for i in args.actor_device_ids], jax.sharding.Mesh(
        np.array(learners), ("env",)
    )


def env_axis(path) -> int:
    """The env axis of a rollout's leaf: 0 in bootstrap_obs and state ([B, ...]), else 1 ([T, B,
    ...])."""
    return 0 if path[0].key in ("bootstrap_obs", "state") else 1


def joined(rollouts: list) -> dict:
    """Actor threads' rollouts side by side along the env axis: this process's share of a batch."""
    if len(rollouts) == 1:
        return rollouts[0]
    return jax.tree_util.tree_map_with_path(
        lambda path, *xs: np.concatenate(xs, env_axis(path)), *rollouts
    )


def split_envs(mesh, axis: int):
    """The sharding of arrays whose axis `axis` (their envs) is split over the learner devices."""
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*[None] * axis, "env"))


def to_learner(mesh, rollout):
    """The one transfer of a rollout to the learner devices: this process's share of the global
    batch, split along the env axis over its learner devices."""
    # host arrays: the jitted update takes them in its call,
    if jax.process_count() == 1 and mesh.size == 1:
        return rollout  # 5x cheaper than a device_put of its own for a replay round's small batches
    by_axis = [split_envs(mesh, 0), split_envs(mesh, 1)]
    shardings = jax.tree_util.tree_map_with_path(lambda path, _: by_axis[env_axis(path)], rollout)
    if jax.process_count() == 1:
        return jax.device_put(rollout, shardings)  # one call for all leaves
    return jax.tree.map(jax.make_array_from_process_local_data, shardings, rollout)


def replicated(mesh, tree):
    """`tree` (the same values in every process) on every learner device."""
    return jax.device_put(
        jax.device_get(tree), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    )


def to_actor(device, params):
    """The learner's parameters copied to an actor's device from a local replica (None, or the
    one device that holds them already: as they are)."""
    if device is None or jax.tree.leaves(params)[0].sharding.device_set == {device}:
        return params
    return jax.tree.map(lambda x: jax.device_put(x.addressable_data(0), device), params)


def actor_key(key, index: int):
    """The action-sampling key of actor `index`, counted over all processes; actor 0 keeps `key`."""
    return jax.random.fold_in(key, index) if index else key


def agree_on_flags(args, error):
    """With many processes, in every process (a collective, once): `error` (a UsageError or None)
    becomes every process's error if one has one, or if their flags differ (all but --process-id
    must match). One process: `error` as it is."""
    if jax.process_count() == 1:
        return error
    flags = json.dumps(
        {k: v for k, v in dataclasses.asdict(args).items() if k != "process_id"}, sort_keys=True
    )
    digest = int(hashlib.sha256(flags.encode()).hexdigest()[:7], 16)
    table = multihost_utils.process_allgather(np.array([error is not None, digest]))
    if error is None and table[:, 0].any():
        return UsageError("another process stopped on a bad flag (its log names it)")
    if error is None and len(set(table[:, 1])) > 1:
        return UsageError(
            "the processes were given different flags: give each the same, but --process-id"
        )
    return error


def agree(received: list, stopped: bool, episodes: list):
    """Once per update, in lockstep (a collective): (whether every process stops now, the (env,
    return, length) of the games that every process finished). A process says 128 + n after
    signal n (`received`), 1 when it stops otherwise, 0 to go on, and all stop if one does:
    another's signal becomes this one's (the same exit code, a checkpoint), and another's error
    raises here. One process: (whether it stops, its own games)."""
    mine = 128 + received[0] if received else int(stopped)
    if jax.process_count() == 1:
        return mine > 0, episodes
    counts = multihost_utils.process_allgather(np.array([mine, len(episodes)]))
    table = np.zeros((max(1, counts[:, 1].max()), 3))
    table[: len(episodes)] = np.reshape(episodes, (-1, 3))
    tables = multihost_utils.process_allgather(table)
    code = int(counts[:, 0].max())
    if code == 1 and mine == 0:
        raise RuntimeError("another process stopped with an error; its log has the traceback")
    if code > 1 and not received:
        received.append(code - 128)
    return code > 0, [
        (int(e), float(r), int(n)) for t, k in zip(tables, counts[:, 1]) for e, r, n in t[:k]
    ]


def peer_failure(error) -> bool:
    """Whether `error` is a collective that failed because another process of the run is gone."""
    return jax.process_count() > 1 and any(
        s in str(error) for s in ("Connection closed by peer", "Connection reset by peer")
    )


def describe_dead(error) -> str:
    """One line for `peer_failure`: with two processes the other one, else the peer's address."""
    me, count = jax.process_index(), jax.process_count()
    peer = re.search(r"closed by peer \[?([^\s\]]+)\]?(:\d+)?", str(error))
    who = (
        f"process {1 - me}"
        if count == 2
        else f"another process ({peer[1] if peer else 'address unknown'})"
    )
    return (
        f"{who} of this run stopped answering (it died, was killed or lost its connection; its "
        f"own log says "
        f"why); process {me} stops too"
    )


def use_compile_cache(path: str):
    """JAX's persistent compilation cache in `path` ('': off), set before anything compiles (JAX
    reads it once per process). UsageError if the folder cannot be created or written."""
    if not path:
        return
    path = os.path.expanduser(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UsageError(
            f"--compile-cache {path}: cannot create it ({e.strerror}); pass another folder, or '' "
            f"for none"
        )
    if not os.access(path, os.W_OK):
        raise UsageError(
            f"--compile-cache {path} is not writable; pass another folder, or '' for none"
        )
    jax.config.update("jax_compilation_cache_dir", path)
