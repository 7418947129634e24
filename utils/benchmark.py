"""The paper's throughput comparison in one command (Sample Factory §4, Fig. 3 and Table 1).

1. ceiling:    raw envpool stepping with random actions (no policy), per thread count (your
               Gymnasium env: the package's worker processes, per process count, and
               Gymnasium's AsyncVectorEnv with shared memory, a process an env, beside them);
2. sampler:    appo_envpool.py's actor loop with the jitted policy and no learning, with
               --num-splits 1 and 2 at the same --num-envs and one env thread (double buffering),
               with --lstm at 2 splits (the recurrent actor's cost against the feed-forward one),
               and appo_envpool_xla.py's actor (one jitted loop a rollout) at 1 and 2 splits;
3. end_to_end: training throughput of the scripts with matching flags over a sweep of
               --num-envs, with the fraction of wall time each stage is busy;
4. replay:     (with --parts ... replay) --replay-script (dqn_envpool.py, sac_envpool.py or
               td3_envpool.py) at its defaults (and --replay-flags), asynchronous and --serial
               (rlpyt's two modes, the same replay ratio), each trained for --replay-budget env
               steps: SPS, steps and seconds to a 20-episode mean of --replay-threshold, the
               replay ratio achieved and the policy lag;
5. network:    (with --parts ... network) the Nature CNN alone (utils/network_speed.py): its
               forward pass at the actor's batch (--num-envs / 2) and one Adam step at the
               learner's minibatch of 256, with the convolutions as matmuls (--conv matmul, the
               CPU's default) and native (--conv native), and in torch where --torch-python can
               import it;
6. scaling:    (with --parts ... scaling) appo_envpool.py end to end on 1, 2 and 4 learner
               devices x 1 and 2 actor threads: SPS and the update's time per global batch. On a
               CPU, XLA_FLAGS gives each run 4 host devices, which share the cores: the figures
               show the overhead of sharding, not a speed-up. A machine with 4 GPUs runs the same.

Writes results.json, results.md and PNG plots into runs/benchmark__<timestamp>/ (or --out).
SPS counts agent steps; FPS counts environment frames (agent steps x frame skip).

Usage: python utils/benchmark.py [--quick] [--env-id Pong-v5]
       python utils/benchmark.py --env-id CartPole-v1 --parts scaling     (the scaling sweep alone)
       python utils/benchmark.py --env-id CartPole-v1 --parts replay      (DQN, async vs serial)
       python utils/benchmark.py --env-id HalfCheetah-v4 --parts replay --replay-script
       sac_envpool.py \
           --replay-budget 300000 --replay-threshold 3000                  (SAC, async vs serial)
       python utils/benchmark.py --env-id examples.corridor:Corridor --env-kwargs '{"length": 8}'
       --parts replay \
           --replay-flags=--lstm --replay-budget 60000 --replay-threshold 0.5  (R2D2, async vs
           serial)
"""

import dataclasses
import json
import os
import platform
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from importlib import metadata
from typing import Optional

import numpy as np

from pathlib import Path

from jax_async_rl import checkpoints, tasks, threads
from jax_async_rl.checkpoints import METRICS
from jax_async_rl.flags import UsageError, run_tool

ROOT = str(Path(__file__).resolve().parent.parent)
# The training scripts, in the repository root; the first is the baseline the others are compared
# with.
SCRIPTS = ("ppo_sync_baseline.py", "appo_envpool.py", "impala_envpool.py", "appo_envpool_xla.py")
XLA_SCRIPT = "appo_envpool_xla.py"
REPLAY_SCRIPTS = ("dqn_envpool.py", "sac_envpool.py", "td3_envpool.py")
PARTS = ("ceiling", "sampler", "end_to_end", "replay", "network", "scaling")
NETWORK_FORMS = ("native", "matmul", "torch")  # utils/network_speed.py --conv


def load_script(name: str):
    return checkpoints.load_script(os.path.join(ROOT, name))


@dataclass
class Args:
    """Throughput benchmark: ceiling, sampler (double buffering) and end-to-end training."""

    env_id: str = "Pong-v5"
    """envpool task to measure, or your own Gymnasium env (module:callable, or with --env-module)"""
    env_module: Optional[str] = None
    """the module that registers --env-id with Gymnasium (your own env)"""
    env_kwargs: str = ""
    """your Gymnasium env's keyword arguments, a JSON object"""
    quick: bool = False
    """about 5 minutes instead of about 20: shorter measurements, a smaller sweep"""
    num_envs: int = 64
    """environments for the ceiling and sampler measurements (2 splits of 32, as Cleanba's Atari
    runs: a large batch spreads each inference call's fixed cost; see docs/results.md for 8 to
    64)"""
    num_steps: int = 64
    """rollout length for the sampler and for every end-to-end run (matching flags)"""
    pin: bool = True
    """sampler: pin envpool's thread to one core and the actor with XLA inference to the others
    (--no-pin: the OS schedules both, and XLA uses every core)"""
    ceiling_threads: tuple[int, ...] = (1, 0)
    """envpool thread counts for the ceiling (0: one per CPU core)"""
    sweep_num_envs: Optional[tuple[int, ...]] = None
    """--num-envs values of the end-to-end sweep (default: 4 8 16; with --quick: 8)"""
    seconds: Optional[float] = None
    """length of each ceiling/sampler measurement in seconds (default 15; with --quick 5)"""
    e2e_seconds: Optional[float] = None
    """seconds each end-to-end run trains after its first update (compilation excluded; default
    60; --quick 25)"""
    scripts: tuple[str, ...] = SCRIPTS
    """training scripts of the end-to-end part (empty: skip it)"""
    parts: tuple[str, ...] = ("ceiling", "sampler", "end_to_end")
    """which measurements to run, of ceiling, sampler, end_to_end, replay, network and scaling"""
    replay_script: str = "dqn_envpool.py"
    """replay: the replay-family script measured: dqn_envpool.py, sac_envpool.py or
    td3_envpool.py"""
    replay_budget: int = 60_000
    """replay: env steps each --replay-script run trains (async, then --serial)"""
    replay_threshold: float = 475.0
    """replay: the 20-episode mean return whose first crossing is timed"""
    replay_flags: str = ""
    """replay: more flags of --replay-script, as on its command line (e.g. '--lstm': R2D2)"""
    torch_python: str = sys.executable
    """network: the Python that times torch's side (a venv of its own, say); its row is left out,
    with a note, where it cannot import torch"""
    scaling_learners: tuple[int, ...] = (1, 2, 4)
    """scaling: learner device counts (--learner-device-ids 0 .. n-1)"""
    scaling_actor_threads: tuple[int, ...] = (1, 2)
    """scaling: --num-actor-threads values (each thread with --num-envs 8 of its own, on device
    0)"""
    deterministic: bool = False
    """end_to_end: also run each asynchronous script with --deterministic (IMPALA at --actor-lag 1,
    the XLA actor with one split, as the mode needs), each beside its free-running row"""
    xla_actor: bool = True
    """also measure appo_envpool_xla.py's sampler (1 and 2 splits), and end to end when --scripts
    names it"""
    out: Optional[str] = None
    """output folder (default: runs/benchmark__<timestamp>)"""


def frame_skip(env_id: str) -> int:
    """Frames per agent step: the Atari frame skip (4), else 1."""
    import envpool

    config = envpool.make_spec(env_id).config
    return int(getattr(config, "frame_skip", 1)) if hasattr(config, "episodic_life") else 1


def machine_info() -> dict:
    import jax

    versions = {}
    for package in ["jax", "jaxlib", "flax", "optax", "envpool", "numpy", "gymnasium"]:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "packages": versions,
    }


def measure_ceiling(env_id, num_envs, num_threads, seconds, async_vector_env=False):
    """Agent steps per second of envpool alone, synchronous stepping with random actions (or of
    a user's env in Gymnasium's AsyncVectorEnv, shared memory, a process an env)."""
    if async_vector_env:
        import gymnasium

        envs = gymnasium.vector.AsyncVectorEnv(
            [tasks.USER_ENVS[env_id]] * num_envs, shared_memory=True, context="spawn"
        )
    else:
        envs = tasks.make_env(env_id, num_envs, 1, num_threads, train=True)
    space = envs.single_action_space if async_vector_env else envs.action_space
    rng = np.random.default_rng(0)
    envs.reset()
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        if hasattr(space, "n"):
            action = rng.integers(0, space.n, num_envs)
        else:
            action = rng.uniform(space.low, space.high, (num_envs, *space.shape)).astype(
                space.dtype
            )
        envs.step(action)
        steps += num_envs
    sps = steps / (time.perf_counter() - start)
    envs.close()
    return sps


# The sampler gives inference a core of its own, as a GPU gives it a device of its own: envpool's
# one thread is pinned to the first core (envpool's `thread_affinity_offset`), the actor thread and
# XLA to the others, and XLA's intra-op thread pool (sized by the machine's core count, not by the
# affinity mask) is switched off so that inference does not time-slice the env core. Unpinned, the
# scheduler mixes env stepping, inference and the actor's bookkeeping on both cores (Pong-v5 on
# 2 cores, 32 envs: 2 splits 1.55x of 1 split and 77% of the ceiling, against 2.13x and 91% pinned).
SAMPLER_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"


def core_layout():
    """(env core, actor cores) for the sampler, or None where threads can't be pinned (one core,
    or no sched_setaffinity, as on macOS)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    return (cores[0], cores[1:]) if len(cores) > 1 else None


def measure_sampler(
    env_id,
    num_envs,
    num_splits,
    num_steps,
    seconds,
    pin=True,
    lstm=False,
    xla=False,
    user=(None, ""),
):
    """Sampler throughput, measured in a fresh process (pinning and XLA flags must not leak into
    this one or its later runs): (agent steps per second, busy fraction per stage, layout)."""
    import multiprocessing

    layout = core_layout() if pin else None
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(
        target=sampler_process,
        args=(env_id, num_envs, num_splits, num_steps, seconds, layout, results, lstm, xla, user),
        daemon=False,
    )  # not daemonic: a user env's worker processes are its children
    child.start()
    deadline = time.monotonic() + seconds + 300
    try:
        while True:  # wait for the result, but not on a child that died (a crash in C++ code)
            try:
                outcome, value = results.get(
                    timeout=1.0 if child.is_alive() and time.monotonic() < deadline else 5.0
                )
                break
            except queue.Empty:
                if not child.is_alive() or time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"the sampler process gave no result (exit code {child.exitcode})"
                    ) from None
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    if outcome == "error":
        raise RuntimeError(f"the sampler process failed:\n{value}")
    sps, busy, threads_on_env_core = value
    if not layout:
        return sps, busy, None
    return (
        sps,
        busy,
        {
            "env_core": layout[0],
            "actor_cores": layout[1],
            "threads_on_env_core": threads_on_env_core,
        },
    )


def sampler_process(
    env_id, num_envs, num_splits, num_steps, seconds, layout, results, lstm, xla, user
):
    """Child process of measure_sampler: pin, then run the actor loop; report through `results`."""
    try:
        if layout:
            os.environ["XLA_FLAGS"] = (
                f"{os.environ.get('XLA_FLAGS', '')} {SAMPLER_XLA_FLAGS}".strip()
            )
            os.sched_setaffinity(
                0, layout[1]
            )  # this thread and every thread it starts, not envpool's
        appo = load_script(XLA_SCRIPT if xla else "appo_envpool.py")
        env_core = layout[0] if layout else None
        results.put(
            (
                "ok",
                run_sampler(
                    appo, env_id, num_envs, num_splits, num_steps, seconds, env_core, lstm, user
                ),
            )
        )
    except BaseException:
        results.put(("error", traceback.format_exc()))


# The actor's stages (threads.Shared.timing; appo_envpool_xla.py counts its whole call as env):
# waiting in recv(), dispatching inference, the rollout bookkeeping, waiting for the actions
# (device_get), and waiting on a full queue.
ACTOR_STAGES = ["env", "inference", "bookkeeping", "device_get", "queue_put"]


def run_sampler(
    appo,
    env_id,
    num_envs,
    num_splits,
    num_steps,
    seconds,
    env_core=None,
    lstm=False,
    user=(None, ""),
):
    """Agent steps per second of `appo`'s actor_loop (appo_envpool.py's or appo_envpool_xla.py's;
    jitted policy, with an LSTM if `lstm`; one env thread, pinned to `env_core` if given), with a
    consumer that drops rollouts: sampling alone, no learning.
    Returns (SPS, busy fraction of each actor stage (ACTOR_STAGES), threads found pinned to
    env_core)."""
    import jax

    args = appo.resolve_args(
        appo.Args(
            env_id=env_id,
            num_envs=num_envs,
            num_splits=num_splits,
            num_steps=num_steps,
            num_threads=1,
            lstm=lstm,
            env_module=user[0],
            env_kwargs=user[1],
        )  # a user's env: registered in this process too
    )
    pin = {} if env_core is None else {"thread_affinity_offset": env_core}
    envs = tasks.make_env(
        env_id, num_envs, 1, 1, train=True, batch_size=num_envs // num_splits, **pin
    )
    threads_on_env_core = None  # threads allowed on env_core only: 1 (envpool's) if the pin held
    if env_core is not None and os.path.isdir("/proc/self/task"):
        threads_on_env_core = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                threads_on_env_core += os.sched_getaffinity(int(tid)) == {env_core}
            except OSError:  # the thread ended meanwhile
                pass
    network, _, continuous, _, state = appo.build(args, jax.random.PRNGKey(0))
    params, split_size = state["params"], num_envs // num_splits
    policy_step = appo.make_policy_step(network, continuous, values=False)  # as the actor uses it
    warm = (
        tasks.zeros_like_space(tasks.spaces(env_id)[0], split_size),
        appo.zero_core(network.lstm_size, split_size),
    )
    ids = np.arange(split_size)  # env ids and steps: each env's draws are keyed by both
    # Compile outside the clock
    jax.block_until_ready(
        policy_step(params, *warm, jax.random.PRNGKey(0), ids, np.zeros_like(ids))
    )
    shared = threads.Shared(params, 0)
    rollouts, actors = queue.Queue(maxsize=2), threads.Threads(shared.stop)
    actor = actors.start(
        "actor",
        appo.actor_loop,
        envs,
        policy_step,
        shared,
        rollouts,
        jax.random.PRNGKey(1),
        args,
        tasks.policy_space(args.env_id),
        10**9,
    )
    # Count whole rollouts between the first arrival and the last: steps / time between arrivals
    # has no partial rollout at either end (a rollout can take a second or more).
    arrivals = []  # (time, cumulative stage timings) at each rollout's arrival
    deadline = time.perf_counter() + seconds + 60  # generous: the first rollout may be slow
    while time.perf_counter() < deadline and not (
        arrivals and arrivals[-1][0] - arrivals[0][0] >= seconds
    ):
        try:
            rollouts.get(timeout=0.5)
        except queue.Empty:
            continue
        arrivals.append((time.perf_counter(), dict(shared.timing)))
    shared.stop.set()
    actor.join(timeout=10)
    envs.close()
    if actors.errors:
        raise RuntimeError(actors.errors[0][2])
    if len(arrivals) < 2:
        raise RuntimeError(f"the sampler delivered fewer than 2 rollouts in {seconds + 60:.0f}s")
    (start, timing0), (end, timing1) = arrivals[0], arrivals[-1]
    elapsed = end - start
    busy = {k: (timing1[k] - timing0[k]) / elapsed for k in ACTOR_STAGES if k in timing1}
    return (len(arrivals) - 1) * num_envs * num_steps / elapsed, busy, threads_on_env_core


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def logged_update(metrics_file) -> bool:
    """Whether a run's metrics.jsonl holds an update's scalars yet."""
    try:
        with open(metrics_file) as f:
            return '"losses/loss"' in f.read()
    except FileNotFoundError:
        return False


def measure_end_to_end(
    script, env_id, num_envs, num_steps, seconds, out_dir, extra=(), env=None, name=""
):
    """Run `script` (with `extra` flags, environment `env`) until its first update is logged
    (start-up and compilation, however long a busy machine makes them), then `seconds` more; stop
    it with SIGINT, and read its throughput from metrics.jsonl between its first and last update
    (compilation excluded): (SPS, busy fraction per stage, updates, update seconds per update)."""
    run_dir = os.path.join(out_dir, "e2e", f"{script[:-3]}__{num_envs}{name}")
    cmd = [
        sys.executable,
        os.path.join(ROOT, script),
        "--env-id",
        env_id,
        "--num-envs",
        str(num_envs),
        "--num-steps",
        str(num_steps),
        "--total-timesteps",
        str(10**9),
        "--eval-episodes",
        "0",
        "--save-interval",
        "0",
        "--log-frequency",
        "1",
        "--run-dir",
        run_dir,
        *extra,
    ]
    if script != "impala_envpool.py" and num_envs * num_steps % 4:
        cmd += ["--num-minibatches", "1"]
    shutil.rmtree(run_dir, ignore_errors=True)  # a previous benchmark's, in the same --out
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    metrics_file = os.path.join(run_dir, METRICS)
    deadline = (
        time.time() + 900
    )  # the first update: minutes for the Atari CNN's compile on a busy CPU
    while time.time() < deadline and proc.poll() is None and not logged_update(metrics_file):
        time.sleep(0.5)
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    stderr = proc.stderr.read()
    if proc.returncode not in (0, 128 + signal.SIGINT):
        raise RuntimeError(f"{script} exited with code {proc.returncode}:\n{stderr[-2000:]}")
    if not os.path.exists(metrics_file):
        raise RuntimeError(f"{script} wrote no metrics:\n{stderr[-2000:]}")
    updates = [r for r in read_metrics(metrics_file) if r["tag"] == "losses/loss"]
    if len(updates) < 2:
        return None  # slower than one update after compilation in the time given
    first, last = updates[0], updates[-1]
    wall = last["wall_time"] - first["wall_time"]
    sps = (last["step"] - first["step"]) / wall
    timing = {}  # cumulative seconds per stage at the first and the last update
    for r in read_metrics(metrics_file):
        if (
            r["tag"].startswith("timing/")
            and r["tag"].endswith("_seconds")
            and r["step"] in (first["step"], last["step"])
        ):
            timing.setdefault(r["tag"][len("timing/") : -len("_seconds")], []).append(r["value"])
    busy = {stage: round((v[-1] - v[0]) / wall, 3) for stage, v in timing.items()}
    return sps, busy, len(updates), busy.get("update", 0.0) * wall / (len(updates) - 1)


def measure_replay(script, env_id, serial: bool, budget: int, threshold: float, out_dir, flags=()):
    """A replay-family script at its defaults, asynchronous or --serial, trained for `budget` env
    steps: SPS between its first and last update, env steps and seconds (from the first update) to
    the first 20-episode mean at `threshold` (None: not reached), the replay ratio it logged last
    and its mean policy lag (rounds between the parameters a chunk was collected with and the
    update). `flags`: more of the script's flags."""
    run_dir = os.path.join(out_dir, "replay", "serial" if serial else "async")
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [
        sys.executable,
        os.path.join(ROOT, script),
        "--env-id",
        env_id,
        "--total-timesteps",
        str(budget),
        "--eval-episodes",
        "0",
        "--save-interval",
        "0",
        "--log-frequency",
        "1",
        "--run-dir",
        run_dir,
        *(["--serial"] if serial else []),
        *flags,
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{script} exited with code {proc.returncode}:\n{proc.stderr[-2000:]}")
    records = read_metrics(os.path.join(run_dir, METRICS))
    updates = [
        r for r in records if r["tag"] in ("losses/loss", "losses/qf_loss")
    ]  # DQN's, SAC's and TD3's
    if len(updates) < 2:
        return None
    first, last = updates[0], updates[-1]
    games = [r for r in records if r["tag"] == "charts/episodic_return"]
    means = (
        np.convolve([r["value"] for r in games], np.ones(20) / 20, "valid")
        if len(games) >= 20
        else []
    )
    hit = next((games[i + 19] for i, m in enumerate(means) if m >= threshold), None)
    values = lambda tag: [r["value"] for r in records if r["tag"] == tag]
    config = json.loads(open(os.path.join(run_dir, "config.json")).read())
    return dict(
        sps=(last["step"] - first["step"]) / (last["wall_time"] - first["wall_time"]),
        steps_to_threshold=hit["step"] if hit else None,
        seconds_to_threshold=hit["wall_time"] - first["wall_time"] if hit else None,
        best_mean=float(max(means, default=float("nan"))),
        replay_ratio=values("replay/ratio")[-1],
        target_ratio=config["replay_ratio"],
        policy_lag=float(np.mean(values("async/policy_lag_mean"))),
        updates=len(updates),
    )


def measure_network(form: str, forward_batch: int, seconds: float, python: str):
    """utils/network_speed.py's JSON for one form of the network (NETWORK_FORMS), or None where
    torch's Python cannot import torch."""
    if form == "torch":
        probe = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True)
        if probe.returncode != 0:
            return None
    else:
        python = sys.executable
    script = os.path.join(ROOT, "utils", "network_speed.py")
    command = [python, script, "--conv", form, "--forward-batch", str(forward_batch)]
    done = subprocess.run(
        [*command, "--seconds", str(seconds)], capture_output=True, text=True, cwd=ROOT
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_scaling(env_id, num_steps, seconds, out_dir, learners, threads):
    """appo_envpool.py end to end on `learners` learner devices with `threads` actor threads of 8
    envs each (all on device 0); on a CPU, 4 forced host devices. (SPS, busy, updates, update s)."""
    import jax

    env = dict(os.environ)
    if jax.default_backend() == "cpu":
        env["XLA_FLAGS"] = (
            f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
        )
    extra = [
        "--learner-device-ids",
        *map(str, range(learners)),
        "--num-actor-threads",
        str(threads),
    ]
    return measure_end_to_end(
        "appo_envpool.py",
        env_id,
        8,
        num_steps,
        seconds,
        out_dir,
        extra,
        env,
        name=f"__learners{learners}__threads{threads}",
    )


def write_report(out_dir, results, quick):
    """results.md tables and PNG plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    machine = results["machine"]
    hardware = (
        f"{machine['cpu_count']} CPU cores, JAX on {machine['jax_backend']} "
        f"({machine['processor']})"
    )
    rows = results["measurements"]
    lines = [
        f"# Benchmark: {results['env_id']}{' (--quick)' if quick else ''}",
        "",
        f"Hardware: {hardware}.",
    ]
    if any(r["kind"] in ("ceiling", "sampler") for r in rows):
        lines += [
            "",
            "## Ceiling and sampler",
            "",
            "| kind | num_envs | num_splits | env threads | SPS | FPS | of ceiling | actor µs per "
            "env step: "
            "total (env wait, dispatch, bookkeeping, device_get, queue) |",
            "|---|---|---|---|---|---|---|---|",
        ]
    for r in rows:
        if r["kind"] in ("ceiling", "sampler"):
            frac = (
                f"{r['fraction_of_ceiling']:.0%}"
                if r.get("fraction_of_ceiling") is not None
                else ""
            )
            us = ""
            if r["kind"] == "sampler":  # a stage's busy fraction x wall time / steps
                per_step = [r["busy"].get(k, 0.0) * 1e6 / r["sps"] for k in ACTOR_STAGES]
                us = f"{1e6 / r['sps']:.1f} ({', '.join(f'{x:.1f}' for x in per_step)})"
            lines.append(
                f"| {r['kind']}{' --lstm' * r.get('lstm', False)}{' (XLA actor)' * r.get('xla_actor', False)} | {r['num_envs']} | {r['num_splits'] or ''} | {r['num_threads']} | {r['sps']:.0f} | "
                f"{r['fps']:.0f} | {frac} | {us} |"
            )
    samplers = {
        r["num_splits"]: r
        for r in rows
        if r["kind"] == "sampler" and not r.get("lstm") and not r.get("xla_actor")
    }
    xla = {r["num_splits"]: r for r in rows if r["kind"] == "sampler" and r.get("xla_actor")}
    lstm = [r for r in rows if r["kind"] == "sampler" and r.get("lstm")]
    if 1 in samplers and 2 in samplers:
        lines += [
            "",
            f"Double buffering: 2 splits / 1 split = "
            f"**{samplers[2]['sps'] / samplers[1]['sps']:.2f}x**.",
        ]
    if 1 in xla and 2 in xla:
        lines += [
            "",
            f"Double buffering with the XLA actor ({XLA_SCRIPT}): 2 splits / 1 split = "
            f"**{xla[2]['sps'] / xla[1]['sps']:.2f}x**.",
        ]
        if 1 in samplers and 2 in samplers:
            lines[-1] += (
                f" The XLA actor / the Python actor: {xla[1]['sps'] / samplers[1]['sps']:.2f}x at "
                f"1 split, "
                f"{xla[2]['sps'] / samplers[2]['sps']:.2f}x at 2 splits."
            )
    if lstm and 2 in samplers:
        lines += [
            "",
            f"Recurrent actor: the --lstm sampler / the feed-forward one (2 splits) = "
            f"**{lstm[0]['sps'] / samplers[2]['sps']:.2f}x**.",
        ]
    if 1 in samplers and 2 in samplers:
        cores = samplers[2].get("cores")
        if cores:
            lines += [
                "",
                f"Sampler layout: envpool's thread pinned to core {cores['env_core']}; the actor "
                f"thread and "
                f"XLA (single-threaded) on cores {cores['actor_cores']}.",
            ]
        else:
            lines += [
                "",
                "Sampler layout: not pinned (--no-pin, one core, or no sched_setaffinity on this "
                "OS).",
            ]
    e2e = [r for r in rows if r["kind"] == "end_to_end"]
    if e2e:
        lines += [
            "",
            "## End to end (training)",
            "",
            "| script | num_envs | num_splits | num_steps | SPS | FPS | of sync | of free-running "
            "| updates | "
            "busy fraction of wall time per stage |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        sync = {r["num_envs"]: r["sps"] for r in e2e if r["script"] == SCRIPTS[0]}
        free = {(r["script"], r["num_envs"]): r["sps"] for r in e2e if not r.get("deterministic")}
        for r in e2e:
            busy = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["busy"].items()))
            ratio = f"{r['sps'] / sync[r['num_envs']]:.2f}x" if r["num_envs"] in sync else ""
            own = (r["script"], r["num_envs"])
            of_free = (
                f"{r['sps'] / free[own]:.2f}x" if r.get("deterministic") and own in free else ""
            )
            name = r["script"] + " --deterministic" * bool(r.get("deterministic"))
            lines.append(
                f"| {name} | {r['num_envs']} | {r.get('num_splits') or ''} | {r['num_steps']} | "
                f"{r['sps']:.0f} | "
                f"{r['fps']:.0f} | {ratio} | {of_free} | {r['updates']} | {busy} |"
            )
    replay = [r for r in rows if r["kind"] == "replay"]
    if replay:
        flags = f" {replay[0]['flags']}" if replay[0].get("flags") else ""
        lines += [
            "",
            f"## Replay ({replay[0]['script']}{flags}: asynchronous vs --serial, the same replay "
            f"ratio)",
            "",
            f"| mode | SPS | steps to a 20-episode mean of {replay[0]['threshold']:g} | seconds "
            f"to it | best mean | "
            "replay ratio achieved (set) | policy lag | rounds |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in replay:
            reached = r["steps_to_threshold"] is not None
            steps, seconds = (
                (r["steps_to_threshold"], f"{r['seconds_to_threshold']:.1f}")
                if reached
                else ("not reached", "")
            )
            lines.append(
                f"| {'serial' if r['serial'] else 'async'} | {r['sps']:.0f} | {steps} | {seconds} "
                f"| "
                f"{r['best_mean']:.1f} | {r['replay_ratio']:.2f} ({r['target_ratio']:g}) | "
                f"{r['policy_lag']:.2f} | "
                f"{r['updates']} |"
            )
        modes = {r["serial"]: r for r in replay}
        if len(modes) == 2:
            lines += [
                "",
                f"Async / serial SPS: **{modes[False]['sps'] / modes[True]['sps']:.2f}x**.",
            ]
    network = {r["conv"]: r for r in rows if r["kind"] == "network"}
    if network:
        lines += [
            "",
            "## Network (the Nature CNN alone: utils/network_speed.py)",
            "",
            "| form | forward ms (batch) | train step ms (batch) | train step of native's | "
            "train step of torch's |",
            "|---|---|---|---|---|",
        ]
        for form, r in network.items():
            of = [
                f"{r['train_ms'] / network[other]['train_ms']:.2f}x" if other in network else ""
                for other in ("native", "torch")
            ]
            lines.append(
                f"| {form} ({r['backend']}) | {r['forward_ms']:.1f} ({r['forward_batch']}) | "
                f"{r['train_ms']:.0f} ({r['train_batch']}) | {of[0]} | {of[1]} |"
            )
    scaling = [r for r in rows if r["kind"] == "scaling"]
    if scaling:
        lines += [
            "",
            "## Scaling (appo_envpool.py)",
            "",
            "| learner devices | actor threads | global batch | SPS | update ms per global batch "
            "| updates |",
            "|---|---|---|---|---|---|",
        ]
        for r in scaling:
            lines.append(
                f"| {r['learner_devices']} | {r['actor_threads']} | {r['num_envs']} x "
                f"{r['num_steps']} | "
                f"{r['sps']:.0f} | {1000 * r['update_seconds']:.1f} | {r['updates']} |"
            )
        if machine["jax_backend"] == "cpu":
            lines += [
                "",
                f"On this CPU the learner devices are {machine['cpu_count']} cores split 4 ways "
                "(XLA_FLAGS): these figures show the cost of sharding and threads, not a speed-up.",
            ]
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")

    fig, ax = plt.subplots(figsize=(6, 4))
    bars = [(f"ceiling\n{r['num_threads']} thr", r["fps"]) for r in rows if r["kind"] == "ceiling"]
    bars += [
        (
            f"sampler{' lstm' * r['lstm']}{' xla' * r.get('xla_actor', False)}\n{r['num_splits']} "
            f"split{'s' * (r['num_splits'] > 1)}",
            r["fps"],
        )
        for r in rows
        if r["kind"] == "sampler"
    ]
    ax.bar([b[0] for b in bars], [b[1] for b in bars], color="tab:blue")
    ax.set_ylabel("FPS (frames / s)")
    ax.set_title(f"{results['env_id']}: sampling throughput\n{hardware}", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "sampler.png"), dpi=120)
    plt.close(fig)
    if e2e:
        fig, ax = plt.subplots(figsize=(6, 4))
        for script, det in sorted({(r["script"], bool(r.get("deterministic"))) for r in e2e}):
            points = sorted(
                (r["num_envs"], r["fps"])
                for r in e2e
                if r["script"] == script and bool(r.get("deterministic")) == det
            )
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                "o-",
                label=script + " --deterministic" * det,
            )
        ax.set_xlabel("num_envs")
        ax.set_ylabel("training FPS (frames / s)")
        ax.set_xscale("log", base=2)
        ax.legend()
        ax.set_title(f"{results['env_id']}: throughput vs environments\n{hardware}", fontsize=9)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "end_to_end.png"), dpi=120)
        plt.close(fig)


def main(args: Args) -> int:
    import envpool

    tasks.register_user_env(args)  # a user's Gymnasium env: checked, made known
    user = args.env_id in tasks.USER_ENVS
    if not user and args.env_id not in envpool.list_all_envs():
        raise UsageError(f"--env-id {args.env_id!r} is not an envpool task")
    if user:  # no XLA interface; its worker processes must not inherit the actor's pinned cores
        args = dataclasses.replace(args, xla_actor=False, pin=False)
    for name in ["num_envs", "num_steps"]:
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    if args.num_envs % 2:
        raise UsageError("--num-envs must be even (the sampler compares 1 and 2 splits)")
    wrong = [p for p in args.parts if p not in PARTS]
    if wrong:
        raise UsageError(f"--parts: unknown {wrong}; choose from {', '.join(PARTS)}")
    unknown = [s for s in args.scripts if s not in SCRIPTS]
    if unknown:
        raise UsageError(f"--scripts: unknown {unknown}; choose from {list(SCRIPTS)}")
    if args.replay_script not in REPLAY_SCRIPTS:
        raise UsageError(
            f"--replay-script {args.replay_script!r}: choose from {', '.join(REPLAY_SCRIPTS)}"
        )
    seconds = args.seconds or (5.0 if args.quick else 15.0)
    e2e_seconds = args.e2e_seconds or (25.0 if args.quick else 60.0)
    sweep = args.sweep_num_envs or ((8,) if args.quick else (4, 8, 16))
    out_dir = args.out or os.path.join(ROOT, "runs", f"benchmark__{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(out_dir, exist_ok=True)

    import jax

    appo = load_script("appo_envpool.py")
    skip = 1 if user else frame_skip(args.env_id)
    results = {
        "env_id": args.env_id,
        "frame_skip": skip,
        "config": dataclasses.asdict(args),
        "machine": machine_info(),
        "measurements": [],
    }
    jobs = [("ceiling", t) for t in args.ceiling_threads] * ("ceiling" in args.parts)
    jobs += [("ceiling", "AsyncVectorEnv")] * ("ceiling" in args.parts and user)
    jobs += [
        ("sampler", (1, False, False)),
        ("sampler", (2, False, False)),
        ("sampler", (2, True, False)),
    ] * ("sampler" in args.parts)
    jobs += [("sampler", (1, False, True)), ("sampler", (2, False, True))] * (
        "sampler" in args.parts and args.xla_actor
    )
    scripts = [s for s in args.scripts if args.xla_actor or s != XLA_SCRIPT]
    modes = (False, True) if args.deterministic else (False,)
    jobs += [
        ("end_to_end", (script, n, det))
        for n in sweep
        for script in scripts
        for det in modes
        if not det or script != SCRIPTS[0]
    ] * ("end_to_end" in args.parts)
    jobs += [("replay", serial) for serial in (False, True)] * ("replay" in args.parts)
    jobs += [("network", form) for form in NETWORK_FORMS] * ("network" in args.parts)
    devices = len(jax.devices()) if jax.default_backend() != "cpu" else 4
    jobs += [
        ("scaling", (n, t))
        for n in args.scaling_learners
        if n <= devices
        for t in args.scaling_actor_threads
    ] * ("scaling" in args.parts)
    start = time.time()
    for i, (kind, param) in enumerate(jobs):
        print(
            f"[{i + 1}/{len(jobs)}] {kind} {param}  ({time.time() - start:.0f}s elapsed)",
            flush=True,
        )
        row = {
            "kind": kind,
            "script": None,
            "env_id": args.env_id,
            "num_envs": args.num_envs,
            "num_splits": None,
            "num_threads": None,
            "num_steps": None,
            "lstm": False,
            "xla_actor": False,
        }
        if kind == "ceiling" and param == "AsyncVectorEnv":
            row.update(
                num_threads=f"{args.num_envs} (AsyncVectorEnv)",
                sps=measure_ceiling(args.env_id, args.num_envs, 0, seconds, True),
            )
        elif kind == "ceiling":
            threads = param or min(os.cpu_count() or 1, args.num_envs)
            row.update(
                num_threads=threads,
                sps=measure_ceiling(args.env_id, args.num_envs, threads, seconds),
            )
        elif kind == "network":
            measured = measure_network(
                param, max(args.num_envs // 2, 1), seconds, args.torch_python
            )
            if measured is None:
                print(f"    torch: {args.torch_python} cannot import torch; left out", flush=True)
                continue
            row.update(
                script=None,
                num_envs=None,
                conv=param,
                forward_batch=measured["forward_batch"],
                train_batch=measured["train_batch"],
                forward_ms=measured["forward_ms"],
                train_ms=measured["train_ms"],
                backend=measured["backend"],
            )
            results["measurements"].append(row)
            print(f"    forward {row['forward_ms']:.1f} ms, train step {row['train_ms']:.0f} ms")
            with open(os.path.join(out_dir, "results.json"), "w") as f:
                json.dump(results, f, indent=2)
            continue
        elif kind == "replay":
            flags = [
                *(["--env-module", args.env_module] if args.env_module else []),
                *(["--env-kwargs", args.env_kwargs] if args.env_kwargs else []),
                *shlex.split(args.replay_flags),
            ]
            measured = measure_replay(
                args.replay_script,
                args.env_id,
                param,
                args.replay_budget,
                args.replay_threshold,
                out_dir,
                flags,
            )
            if measured is None:
                print(
                    f"    {args.replay_script} made fewer than 2 updates in --replay-budget "
                    f"{args.replay_budget}",
                    flush=True,
                )
                continue
            row.update(
                script=args.replay_script,
                serial=param,
                num_envs=None,
                threshold=args.replay_threshold,
                flags=args.replay_flags,
                **measured,
            )
        elif kind == "sampler":
            num_splits, lstm, xla = param
            sps, busy, layout = measure_sampler(
                args.env_id,
                args.num_envs,
                num_splits,
                args.num_steps,
                seconds,
                args.pin,
                lstm,
                xla,
                (args.env_module, args.env_kwargs),
            )
            ceiling = [
                r["sps"]
                for r in results["measurements"]
                if r["kind"] == "ceiling" and r["num_threads"] == 1
            ]
            row.update(
                script=XLA_SCRIPT if xla else "appo_envpool.py",
                num_splits=num_splits,
                lstm=lstm,
                xla_actor=xla,
                num_threads=1,
                num_steps=args.num_steps,
                sps=sps,
                busy={k: round(v, 3) for k, v in busy.items()},
                cores=layout,
                fraction_of_ceiling=sps / ceiling[0] if ceiling else None,
            )
        else:
            script, num_envs, det = (
                param if kind == "end_to_end" else ("appo_envpool.py", 8 * param[1], False)
            )
            if kind == "end_to_end":
                flags = [
                    *(["--env-module", args.env_module] if args.env_module else []),
                    *(["--env-kwargs", args.env_kwargs] if args.env_kwargs else []),
                    *(["--deterministic"] if det else []),
                    *(["--actor-lag", "1"] if det and script == "impala_envpool.py" else []),
                    *(["--num-splits", "1"] if det and script == XLA_SCRIPT else []),
                ]
                measured = measure_end_to_end(
                    script,
                    args.env_id,
                    num_envs,
                    args.num_steps,
                    e2e_seconds,
                    out_dir,
                    flags,
                    name="__deterministic" * det,
                )
            else:
                measured = measure_scaling(
                    args.env_id, args.num_steps, e2e_seconds, out_dir, *param
                )
            if measured is None:
                print(
                    f"    {script} finished fewer than 2 updates in {e2e_seconds:.0f}s after its "
                    f"first; raise --e2e-seconds",
                    flush=True,
                )
                continue
            sps, busy, updates, update_seconds = measured
            splits = (
                None
                if script == SCRIPTS[0]
                else 1
                if det and script == XLA_SCRIPT
                else appo.resolve_args(
                    # The default
                    appo.Args(
                        env_id=args.env_id, env_module=args.env_module, env_kwargs=args.env_kwargs
                    )
                ).num_splits
            )
            row.update(
                script=script,
                deterministic=det,
                num_envs=num_envs,
                num_splits=splits,
                xla_actor=script == XLA_SCRIPT,
                num_threads=min(os.cpu_count() or 1, num_envs),
                num_steps=args.num_steps,
                sps=sps,
                busy=busy,
                updates=updates,
                update_seconds=update_seconds,
            )
            if kind == "scaling":
                row.update(learner_devices=param[0], actor_threads=param[1])
        row["fps"] = row["sps"] * skip
        results["measurements"].append(row)
        print(f"    SPS {row['sps']:.0f}  FPS {row['fps']:.0f}", flush=True)
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
    write_report(out_dir, results, args.quick)
    with open(os.path.join(out_dir, "results.md")) as f:
        print(f.read())
    print(f"results: {out_dir}")
    return 0


if __name__ == "__main__":
    run_tool(main, Args)
