"""A training run's life, from its flags to its exit code (`Run`): start-up checks, devices,
resume, the run folder and its config.json, logging after each update, checkpoints, signals,
thread errors, the final evaluation. A script's `main` reads:

    with runs.Run(args, given, __file__, resolve_args) as run:
        if run.finished: return 0                          # a resumed run that has nothing left
        network, optimizer, continuous, normalizer, state = build(run.args, run.init_key)
        state = run.open(state, normalizer)                # --resume's state on the learner devices; the folder
        ...                                                # envs (run.actors()), the jitted functions
        run.begin("preset classic")                        # header line, clock, progress line
        run.threads.run("training loop", train_loop, ...)  # or .start() actor and learner threads
        return run.finish(policy, initial_core)            # checkpoint, evaluation, exit code

and once per update the learner calls `run.should_stop(...)` (stop together, gather games) and
`run.learned(state, diagnostics, timing)` (count, log, checkpoint on schedule).
"""

import dataclasses
import importlib.util
import itertools
import json
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from collections import deque
from pathlib import Path
import jax
import numpy as np

from jax_async_rl import checkpoints, devices, evaluation, tasks
from jax_async_rl.checkpoints import CHECKPOINT, CONFIG
from jax_async_rl.flags import UsageError, check_bounds
from jax_async_rl.logs import Logger, Progress
from jax_async_rl.threads import Threads


class Run:
    """One run of a training script (see the module docstring). Process 0 alone writes the run
    folder; the others keep `run_dir` None."""

    def __init__(self, args, given, script: str, resolve):
        self.given, self.script, self.resolve = given, script, resolve
        self.args = args
        self.pending = None  # (step, scalars) of the last update, not logged yet
        self.episodes = deque()  # with many processes: games finished here, gathered once per update (`should_stop`)
        self.saving = threading.Lock()  # one checkpoint write at a time (the learner's and the main thread's)
        self.run_dir = self.logger = self.progress = None

    def __enter__(self):
        warnings.filterwarnings("ignore", message=".*precision lowered.*")  # gymnasium's Box casts
        self.signals = Signals()
        try:
            self.start_up()
        except BaseException:
            self.signals.close()
            raise
        self.threads = Threads(self.signals.stop)
        return self

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.close()
        if self.logger is not None:
            self.logger.close()
        self.signals.close()
        return False

    def start_up(self):
        """Flags (resumed, resolved, checked), processes, devices; UsageError before anything starts."""
        args, self.payload, self.changed = checkpoints.resume_args(self.args, self.given, self.script)
        args = dataclasses.replace(args, exp_name=args.exp_name or Path(self.script).stem)
        devices.start_processes(args)
        self.args, self.actor_devices, self.mesh = prepare(args, self.resolve, self.payload is not None)
        self.batch_size = devices.global_envs(self.args) * self.args.num_steps
        self.global_step = self.start_step = int(self.payload["state"]["global_step"]) if self.payload else 0
        self.finished = self.payload is not None and self.global_step + self.batch_size > self.args.total_timesteps
        if self.finished:
            print(f"{self.args.resume}: finished, {self.global_step} of --total-timesteps {self.args.total_timesteps} "
                  "steps trained; pass a larger --total-timesteps to train on")
            return
        print(f"jax {jax.__version__} on {jax.default_backend()}: {', '.join(map(str, jax.local_devices()))}", flush=True)
        self.seed = (self.args.seed + self.global_step) % 2**31  # a resumed run draws new env seeds and noise
        self.key, self.init_key, self.update_key = jax.random.split(jax.random.PRNGKey(self.seed), 3)

    def open(self, state: dict, normalizer) -> dict:
        """The run's state and folder. `state` (with the normaliser's statistics) is the initial
        one, or the resumed checkpoint's in its structure, replicated on the learner devices as
        every update returns it (no recompile). Process 0 makes (or reopens) the run folder,
        writes config.json and opens the logs, before any env starts."""
        if self.payload:
            path = checkpoints.checkpoint_path(self.args.resume)
            state = checkpoints.load_checkpoint(self.payload, dict(state, **normalizer.state()), path)
            normalizer.load(state)
        self.normalizer = normalizer
        self.state = dict(devices.replicated(self.mesh, state), global_step=self.global_step)
        self.start_update = self.updates = int(self.state["policy_version"])  # updates: done so far
        self.num_updates = self.start_update + (self.args.total_timesteps - self.global_step) // self.batch_size
        self.sampled = np.zeros(devices.actor_threads(self.args), np.int64)  # env steps each actor sent actions for
        if jax.process_index() == 0:
            self.run_dir, created = make_run_dir(self.args, self.payload is not None)
            self.signals.new_run_dir = self.run_dir if created and self.payload is None else None
            write_config(self.run_dir, self.args, self.changed, self.global_step, devices.describe_batch(self.args))
        self.checkpoint_file = os.path.join(self.run_dir, CHECKPOINT) if self.run_dir else "process 0's"
        self.logger = Logger(self.run_dir, self.args)
        return self.state

    def actors(self) -> list:
        """This process's actor threads, [(device, env seed, action key)]: --num-actor-threads on
        each actor device (one where a script has no such flag), each with --num-envs envs seeded
        apart from every other actor's, counted over all processes; actor 0 keeps the run's key."""
        per_device = getattr(self.args, "num_actor_threads", 1)
        first = jax.process_index() * len(self.actor_devices) * per_device
        placed = [device for device in self.actor_devices for _ in range(per_device)]
        return [(device, self.seed + (first + i) * self.args.num_envs, devices.actor_key(self.key, first + i))
                for i, device in enumerate(placed)]

    @property
    def env_threads(self) -> int:
        """envpool worker threads of each actor's envs: --num-threads, else the cores shared among the actors."""
        actors = devices.actor_threads(self.args)
        return self.args.num_threads or min(max(1, (os.cpu_count() or 1) // actors), self.args.num_envs)

    def begin(self, details: str):
        """The header line (`details`: the preset, the splits, ...), the clock and the progress line."""
        print(f"{os.path.basename(self.script)}: {self.args.env_id} ({details}), {self.num_updates - self.start_update} "
              f"updates of {devices.describe_batch(self.args)} -> {self.run_dir or 'the run folder of process 0'}", flush=True)
        processes = jax.process_count()  # sampled: as if every process sampled at this one's pace
        self.progress = Progress(self.args.total_timesteps,
                                 lambda: (self.start_step + int(self.sampled.sum()) * processes, self.global_step))
        self.start_time = time.time()

    @property
    def stop(self) -> threading.Event:
        return self.signals.stop

    def elapsed(self) -> float:
        """Seconds since `begin`."""
        return time.time() - self.start_time

    def should_stop(self, stopped: bool, episodes=()) -> bool:
        """Once per update, before it, in every process (in lockstep: devices.agree): whether the
        run stops now (a signal, an error, `stopped` here or in another process). The games of
        every process are logged: `episodes`, and those the actors reported."""
        mine = [*episodes, *[self.episodes.popleft() for _ in range(len(self.episodes))]]
        stop, games = devices.agree(self.signals.received, stopped, mine)
        self.log_episodes(self.global_step, games)
        return stop

    def report_episodes(self, episodes: list):
        """The (env, return, length) of games an actor finished: logged now, at the env steps
        sampled so far, or with many processes gathered by the learner's next `should_stop`."""
        if jax.process_count() > 1:
            self.episodes.extend(episodes)
        else:
            self.log_episodes(self.start_step + int(self.sampled.sum()), episodes)

    def log_episodes(self, step: int, episodes):
        for _, ret, length in episodes:
            self.progress.returns.append(ret)
            self.logger.log(step, {"charts/episodic_return": ret, "charts/episodic_length": length})

    def learned(self, state: dict, diagnostics: dict, timing: dict, extra=None) -> dict:
        """After an update: FloatingPointError for a non-finite loss or parameters; else count the
        batch, keep `state` (with its global step) for checkpoints, log the update's scalars at the
        first update, every --log-frequency and at the last, and checkpoint every --save-interval."""
        update_idx, self.updates = self.updates, self.updates + 1
        if not diagnostics["finite"]:
            raise FloatingPointError(f"non-finite loss or parameters at update {update_idx}")
        self.global_step += self.batch_size
        self.state = dict(state, global_step=self.global_step)
        self.signals.started.set()
        scalars = {k if "/" in k else f"losses/{k}": v for k, v in diagnostics.items() if k not in ("finite", "learning_rate")}
        scalars.update(extra or {})
        scalars["charts/learning_rate"] = diagnostics["learning_rate"]
        scalars["charts/SPS"] = (self.global_step - self.start_step) / self.elapsed()
        scalars.update({f"timing/{k}_seconds": v for k, v in timing.items()})
        self.pending = (self.global_step, scalars)
        if update_idx == self.start_update or (update_idx + 1) % self.args.log_frequency == 0 or update_idx + 1 == self.num_updates:
            self.logger.log(*self.pending)
            self.pending = None
        if self.args.save_interval and (update_idx + 1) % self.args.save_interval == 0:
            self.save()
        return self.state

    def save(self):
        with self.saving:
            checkpoints.save_checkpoint(self.checkpoint_file, self.state, self.args, self.normalizer, self.script)

    def wait(self, learner: threading.Thread):
        """The main thread, while the threads train: until the learner ends or the run stops; then
        every thread is stopped and joined (with many processes the learner may first finish an
        update and agree with the others to stop)."""
        try:
            while learner.is_alive() and not self.stop.is_set():
                learner.join(timeout=0.2)
        finally:
            self.threads.join(5 if jax.process_count() == 1 else 60)

    def finish(self, policy, initial_core) -> int:
        """After training: the last scalars, the errors, the checkpoint (not after a non-finite
        loss: the last good one stays), the closing lines, the final evaluation with `policy`
        (see evaluation.evaluate), the exit code."""
        self.progress.close()
        if self.pending:
            self.logger.log(*self.pending)
        if not report_errors(self.threads.errors, self.checkpoint_file, self.global_step):
            self.save()
        if self.threads.errors:
            return 1
        print(self.progress.line(), flush=True)
        received = self.signals.received
        if received:
            print(f"stopped by signal {received[0]} at step {self.global_step}; checkpoint: {self.checkpoint_file}",
                  file=sys.stderr)
            return 128 + received[0]
        if self.progress.returns:
            print(f"final: mean return over the last {len(self.progress.returns)} episodes {np.mean(self.progress.returns):.2f}")
        if not (self.args.eval_episodes and self.run_dir):  # process 0 evaluates
            return 0
        video_dir = os.path.join(self.run_dir, "videos") if self.args.capture_video else None
        print(f"eval: playing {self.args.eval_episodes} episodes with the final policy", flush=True)
        params = devices.to_actor(self.actor_devices[0], self.state["params"])  # evaluated on an actor device
        scores = evaluation.evaluate(policy, params, initial_core, self.args, self.normalizer, self.args.eval_episodes,
                                     video_dir, signals=received)
        if received:
            print(f"evaluation stopped by signal {received[0]} after {len(scores)} episodes; checkpoint: "
                  f"{self.checkpoint_file}", file=sys.stderr)
            return 128 + received[0]
        self.logger.log(self.global_step, {"eval/episodic_return": np.mean(scores)})
        print(f"eval: {len(scores)} episodes, return {np.mean(scores):.2f} +- {np.std(scores):.2f}")
        return 0


def prepare(args, resolve, resumed: bool):
    """Resolve and check the flags (`resolve`: the script's) and pick the devices: (args, actor
    devices, the learner's mesh). UsageError for a bad flag; with many processes, in every process
    if one has one, or if their flags differ (devices.agree_on_flags)."""
    error = actor_devices = mesh = None
    try:
        args = resolve(args)
        use_compile_cache(args.compile_cache)
        actor_devices, mesh = devices.make_mesh(args)
        check_run_dir(args, resumed)
    except UsageError as e:
        error = e
    error = devices.agree_on_flags(args, error)
    if error is not None:
        raise error
    return args, actor_devices, mesh


def checked(args):
    """`args`, once they pass the checks that every script's flags take: the ranges declared in
    Args (flags.check_bounds), --norm-obs on a task with float observations, --track with wandb
    installed, a budget of at least one update. UsageError, one line, for the first that fails."""
    check_bounds(args)
    leaves = jax.tree.leaves(tasks.space_tree(tasks.spaces(args.env_id)[0]))
    if getattr(args, "norm_obs", False) and not any(np.issubdtype(s.dtype, np.floating) for s in leaves):
        raise UsageError(f"--norm-obs is for float observations; {args.env_id} has none: pass --norm-obs False")
    if args.track and importlib.util.find_spec("wandb") is None:
        raise UsageError("--track logs to Weights & Biases, which is not installed: pip install wandb")
    if args.total_timesteps < devices.global_envs(args) * args.num_steps:
        raise UsageError(f"--total-timesteps {args.total_timesteps} is less than one update ({devices.describe_batch(args)})")
    return args


def use_compile_cache(path: str):
    """JAX's persistent compilation cache in `path` ('': off), set before anything compiles (JAX
    reads it once per process). UsageError if the folder cannot be created or written."""
    if not path:
        return
    path = os.path.expanduser(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--compile-cache {path}: cannot create it ({e.strerror}); pass another folder, or '' for none")
    if not os.access(path, os.W_OK):
        raise UsageError(f"--compile-cache {path} is not writable; pass another folder, or '' for none")
    jax.config.update("jax_compilation_cache_dir", path)


def check_run_dir(args, resumed: bool):
    """UsageError if --run-dir names a file, or a folder that holds another run (overwritten otherwise).
    Process 0's to check: it alone writes the folder."""
    if jax.process_index():
        return
    own = resumed and os.path.abspath(args.run_dir or "") == os.path.dirname(os.path.abspath(checkpoints.checkpoint_path(args.resume)))
    if not args.run_dir or own:
        return
    if os.path.exists(args.run_dir) and not os.path.isdir(args.run_dir):
        raise UsageError(f"--run-dir {args.run_dir} is a file, not a folder")
    if os.path.exists(os.path.join(args.run_dir, CHECKPOINT)):
        raise UsageError(
            f"--run-dir {args.run_dir} already holds a run; continue it with --resume {args.run_dir}, or pick another folder"
        )
    if os.path.exists(os.path.join(args.run_dir, CONFIG)):
        raise UsageError(f"--run-dir {args.run_dir} holds a run that saved no checkpoint; remove it or pick another folder")


def make_run_dir(args, resumed: bool):
    """Create the run folder: --run-dir, else a resumed run's own, else a new
    runs/{env_id}__{exp_name}__{seed}__{time} (with _2, _3, ... if runs start in the same second).
    Returns (folder, whether this call created it)."""
    if args.run_dir or resumed:
        run_dir = args.run_dir or os.path.dirname(os.path.abspath(checkpoints.checkpoint_path(args.resume)))
        existed = os.path.isdir(run_dir)
        try:
            os.makedirs(run_dir, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--run-dir {run_dir}: cannot create it ({e.strerror})")
        return run_dir, not existed
    base = os.path.join("runs", f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}")
    for n in itertools.count(1):
        try:
            os.makedirs(base if n == 1 else f"{base}_{n}")
            return (base if n == 1 else f"{base}_{n}"), True
        except FileExistsError:
            continue


def write_config(run_dir: str, args, changed: dict, global_step: int, batch: str):
    """config.json: the run's flags as first resolved, with the update's global `batch` in words,
    never overwritten; each resume appends the flags it changed, and the step it resumed from,
    under "resumes"."""
    path = os.path.join(run_dir, CONFIG)
    config = dict(dataclasses.asdict(args), global_batch=batch)
    if args.resume and os.path.isfile(path):
        try:
            with open(path) as f:
                config = json.load(f)
        except ValueError:  # unreadable: start its record afresh from the resumed flags
            pass
    if args.resume:
        resume = {"step": global_step, "wall_time": time.time(), "from": os.path.abspath(args.resume), "changed": changed,
                  "global_batch": batch}
        config["resumes"] = [*config.get("resumes", []), resume]
    with open(f"{path}.tmp", "w") as f:
        json.dump(config, f, indent=2)
    os.replace(f"{path}.tmp", path)


def report_errors(errors, ckpt_file: str, global_step: int) -> bool:
    """Print the threads' errors (traceback, or one line for a non-finite loss); True if the
    learner stopped on a non-finite loss, so that the last good checkpoint must stay."""
    for where, error, trace in errors:
        if isinstance(error, FloatingPointError):
            print(
                f"error: {error} (step {global_step}); "
                f"{'the last good checkpoint is kept: ' + ckpt_file if os.path.exists(ckpt_file) else 'no checkpoint written'}. "
                "Try a lower --learning-rate or --max-grad-norm.",
                file=sys.stderr,
            )
            return True
        print(f"error in {where}:\n{trace}", file=sys.stderr)
    if errors:
        print(f"stopped by an error at step {global_step}; checkpoint: {ckpt_file}", file=sys.stderr)
    return False


class Signals:
    """Ctrl-C and SIGTERM. The handler records the signal and sets `stop`: the run stops cleanly,
    writes a checkpoint and exits 128 + signal. Before `started` (the first update) there is
    nothing to save, and the main thread may be inside an XLA compile that Python cannot
    interrupt: a thread woken through `signal.set_wakeup_fd` then exits at once, no traceback,
    removing the folder of a new run (`new_run_dir`), which holds nothing to resume from."""

    def __init__(self):
        self.received, self.stop, self.started, self.new_run_dir = [], threading.Event(), threading.Event(), None
        self.handlers = {s: signal.signal(s, self.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        self.read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self.previous_fd = signal.set_wakeup_fd(write_fd)
        self.watcher = threading.Thread(target=self.watch, name="signals", daemon=True)
        self.watcher.start()

    def on_signal(self, signum, frame):
        self.received.append(signum)
        self.stop.set()

    def watch(self):
        while data := os.read(self.read_fd, 1):  # one byte per signal; b"" once `close` runs
            if not self.started.is_set():
                if self.new_run_dir:
                    shutil.rmtree(self.new_run_dir, ignore_errors=True)
                print(f"stopped by signal {data[0]} during start-up: nothing to save", file=sys.stderr, flush=True)
                os._exit(128 + data[0])

    def close(self):
        os.close(signal.set_wakeup_fd(self.previous_fd))
        self.watcher.join()
        os.close(self.read_fd)
        for signum, handler in self.handlers.items():
            signal.signal(signum, handler)
