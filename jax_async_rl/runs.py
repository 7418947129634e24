"""A training run's life, from its flags to its exit code (`Run`): start-up checks, devices,
resume, the run folder and its config.json, logging after each update, checkpoints, signals,
thread errors, the final evaluation. A script's `main` reads:

    with runs.Run(args, given, __file__, resolve_args) as run:
        if run.finished: return 0                          # a resumed run that has nothing left
        network, optimizer, continuous, normalizer, state = build(run.args, run.init_key)
        state = run.open(state, normalizer)                # --resume's state on the learner
        devices; the folder ...                                                # envs
        (run.actors()), the jitted functions run.begin("preset classic")                        #
        header line, clock, progress line run.threads.run("training loop", train_loop, ...)  # or
        .start() actor and learner threads return run.finish(policy, initial_core)            #
        checkpoint, evaluation, exit code

and once per update the learner calls `run.should_stop(...)` (stop together, gather games) and
`run.learned(state, diagnostics, timing)` (count, log, checkpoint on schedule).
"""

import dataclasses
import importlib.util
import os
import sys
import threading
import time
import warnings
from pathlib import Path
import jax
import numpy as np

from jax_async_rl import (
    checkpoints,
    convolution,
    devices,
    evaluation,
    folders,
    journal,
    selfplay,
    tasks,
    threads,
)
from jax_async_rl.checkpoints import CHECKPOINT, JOURNAL
from jax_async_rl.flags import UsageError, budget_note, check_bounds, default_exp_name
from jax_async_rl.logs import Logger, Progress
from jax_async_rl.signals import Signals
from jax_async_rl.threads import Threads


class Run:
    """One run of a training script (see the module docstring). Process 0 alone writes the run
    folder; the others keep `run_dir` None."""

    def __init__(self, args, given, script: str, resolve):
        self.given = given
        self.script = script
        self.resolve = resolve
        self.args = args
        # one checkpoint write at a time (the learner's and the main thread's)
        self.saving = threading.Lock()
        self.run_dir = self.logger = self.progress = self.lock = None
        self.peer_lost = False  # another process died: exit without JAX's shutdown
        self.last_episode_step, self.episode_lock = (
            -1,
            threading.Lock(),
        )  # each game its own step (TensorBoard keeps one a step)
        self.warned = False
        self.pool, self.win_rates = None, selfplay.WinRates()  # --self-play's (see open)
        self.periodic = None  # --eval-interval's evaluations (see open)

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
        try:
            if self.progress is not None:
                self.progress.close()
            if self.logger is not None:
                self.logger.close()  # may fail on a full disk: the rest still runs
        finally:
            if getattr(self, "keeper", None) is not None:  # --deterministic's journal
                self.keeper.journal.close()
            if self.lock is not None:
                self.lock.close()
            self.signals.close()
            # JAX's shutdown would wait for the dead process, then abort this one
            if self.peer_lost:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)
        return False

    def start_up(self):
        """Flags (resumed, resolved, checked), processes, devices; UsageError before anything
        starts."""
        # XLA:CPU runs each call in the calling thread, not handed to a thread of its own (set
        # before the backend starts): an actor's per-step inference waits for no hand-off on busy
        # cores (docs/DESIGN.md, the run's start-up); the GIL is still released while a call runs.
        jax.config.update("jax_cpu_enable_async_dispatch", False)
        folders.probe(self.args)  # another run in the folder: say so first
        args, self.payload, self.changed = checkpoints.resume_args(
            self.args, self.given, self.script
        )
        args = dataclasses.replace(
            args, exp_name=args.exp_name or default_exp_name(Path(self.script).stem, args)
        )
        flags = os.environ.get("XLA_FLAGS", "")
        # GPU kernels without atomics, read at backend start
        if args.deterministic and "xla_gpu_deterministic_ops" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_deterministic_ops=true".strip()
        devices.start_processes(args)
        self.args, self.actor_devices, self.mesh = prepare(
            args, self.resolve, self.payload is not None
        )
        self.batch_size = devices.global_envs(self.args) * self.args.num_steps
        if self.args.num_steps < 4:
            print(
                f"warning: --num-steps {self.args.num_steps}: rollouts this short give the "
                f"returns almost nothing "
                "to bootstrap from and most of an update's time goes to overhead; 4 or more is "
                "usual",
                file=sys.stderr,
                flush=True,
            )
        self.global_step = self.start_step = (
            int(self.payload["state"]["global_step"]) if self.payload else 0
        )
        self.finished = (
            self.payload is not None
            and self.global_step + self.batch_size > self.args.total_timesteps
        )
        if self.finished:
            print(
                f"{self.args.resume}: finished, {self.global_step} of --total-timesteps "
                f"{self.args.total_timesteps} "
                "steps trained; pass a larger --total-timesteps to train on"
            )
            return
        if self.args.pause_at and self.args.pause_at <= self.global_step:
            raise UsageError(
                f"--pause-at {self.args.pause_at} is not past the checkpoint's step "
                f"{self.global_step}: pass a later step, or 0"
            )
        note = budget_note(
            self.args,
            self.given,
            self.global_step,
            self.batch_size,
            devices.describe_batch(self.args),
        )
        if note:
            print(note, file=sys.stderr, flush=True)
        trained = (
            (self.args.total_timesteps - self.global_step) // self.batch_size * self.batch_size
        )
        # replay: a run (or resume) fills its buffer first
        if getattr(self.args, "learning_starts", 0) >= trained:
            raise UsageError(
                f"--learning-starts {self.args.learning_starts} is not below the {trained} env "
                f"steps left of "
                f"--total-timesteps {self.args.total_timesteps}: no gradient step would run; "
                f"lower it or raise the budget"
            )
        self.source = (
            os.path.dirname(checkpoints.checkpoint_path(self.args.resume)) if self.payload else None
        )
        if (
            self.source
            and self.args.deterministic
            and jax.process_count() == 1
            and ("carry" in self.payload or os.path.lexists(os.path.join(self.source, JOURNAL)))
        ):
            journal.check_carry(self.payload, checkpoints.checkpoint_path(self.args.resume))
            # the journal that journal_for will replay, checked now
            space = tasks.policy_space(self.args.env_id)
            journal.verify(
                self.source,
                self.payload.get("carry"),
                int(self.payload["state"].get("policy_version", 0)),
                (self.args.num_steps, devices.local_envs(self.args), *space.shape),
                space.dtype,
                space,
            )
        print(
            f"jax {jax.__version__} on {jax.default_backend()}: "
            f"{', '.join(map(str, jax.local_devices()))}",
            flush=True,
        )
        self.seed = (
            self.args.seed + self.global_step
        ) % 2**30  # a resumed run draws new seeds; within int32 (flags.SEED)
        self.env_seed, self.keeper = (
            self.seed,
            None,
        )  # journal_for: the run's own seeds, to replay its envs
        # Keys from --seed alone: draws are keyed by env and step, updates by their number
        # (fold_in).
        self.key, self.init_key, self.update_key = jax.random.split(
            jax.random.PRNGKey(self.args.seed), 3
        )

    def open(self, state: dict, normalizer, pool=None) -> dict:
        """The run's state and folder. `state` (with the normaliser's statistics, and --self-play's
        opponent `pool`, selfplay.Pool) is the initial one, or the resumed checkpoint's in its
        structure, replicated on the learner devices as every update returns it (no recompile).
        Process 0 makes (or reopens) the run folder, writes config.json and opens the logs, before
        any env starts."""
        pending = []  # --eval-interval's evaluations the checkpoint had not played
        if self.payload:
            path = checkpoints.checkpoint_path(self.args.resume)
            extra = pool.state() if pool is not None else {}
            state = checkpoints.load_checkpoint(
                self.payload, dict(state, **normalizer.state(), **extra), path
            )
            normalizer.load(state)
            stored = self.payload["state"].get("evaluations") if self.args.eval_interval else None
            pending = evaluation.restore_pending(  # checked before the folder is touched
                stored, state["params"], normalizer, self.global_step, path
            )
            if pool is not None:
                pool.load(state)
                if not pool.snapshots:  # a checkpoint that kept none: its parameters play
                    pool.add(0, state["params"])
        elif pool is not None:  # the initial parameters: version 0's snapshot
            pool.add(0, state["params"])
        self.normalizer, self.pool = normalizer, pool
        self.state = dict(devices.replicated(self.mesh, state), global_step=self.global_step)
        self.start_update = self.updates = int(self.state["policy_version"])  # updates: done so far
        # a resumed run's games come after the checkpoint's
        self.last_episode_step = self.start_step
        self.num_updates = (
            self.start_update + (self.args.total_timesteps - self.global_step) // self.batch_size
        )
        # env steps each actor sent actions for
        self.sampled = np.zeros(devices.actor_threads(self.args), np.int64)
        if jax.process_index() == 0:
            own = folders.own_folder(self.args)
            # a launcher's log.txt
            before = set(os.listdir(own)) if own and os.path.isdir(own) else None
            self.run_dir, created, self.lock = folders.make(self.args, self.payload is not None)
            # a new run stopped before its first update removes what it wrote
            if self.payload is None:
                self.signals.new_run = (self.run_dir, None if created else before)
            path = checkpoints.checkpoint_path(self.args.resume) if self.payload else None
            if (
                path
                and not os.path.exists(path)
                and folders.same_folder(os.path.dirname(path), self.run_dir)
            ):
                # resumed from a complete .tmp: make it the checkpoint
                checkpoints.finish_rename(path)
            # A resume cuts the metrics past its checkpoint before config.json records it
            dropped = folders.cut_metrics(self.run_dir, self.global_step) if self.payload else 0
            if dropped:
                print(
                    f"note: {dropped} records past step {self.global_step} (after the checkpoint, "
                    f"which the resume "
                    "trains again) cut from metrics.jsonl",
                    file=sys.stderr,
                )
            folders.write_config(
                self.run_dir,
                self.args,
                self.changed,
                self.global_step,
                devices.describe_batch(self.args),
            )
        self.checkpoint_file = (
            os.path.join(self.run_dir, CHECKPOINT) if self.run_dir else "process 0's"
        )
        self.logger = Logger(
            self.run_dir, self.args, purge_step=self.global_step + 1 if self.payload else None
        )
        if self.args.eval_interval and self.run_dir:  # process 0 evaluates
            self.periodic = evaluation.Periodic(
                self.args, normalizer, self.logger, self.actor_devices[0], self.threads, pending
            )
        return self.state

    def actors(self) -> list:
        """This process's actor threads, [(device, env seed, action key)]: --num-actor-threads on
        each actor device (one where a script has no such flag), each with --num-envs envs seeded
        apart from every other actor's, counted over all processes; actor 0 keeps the run's key."""
        per_device = getattr(self.args, "num_actor_threads", 1)
        first = jax.process_index() * len(self.actor_devices) * per_device
        placed = [device for device in self.actor_devices for _ in range(per_device)]
        return [
            (
                device,
                self.env_seed + (first + i) * self.args.num_envs,
                devices.actor_key(self.key, first + i),
            )
            for i, device in enumerate(placed)
        ]

    @property
    def env_threads(self) -> int:
        """envpool worker threads of each actor's envs: --num-threads, else the cores shared
        among the actors."""
        actors = devices.actor_threads(self.args)
        return self.args.num_threads or min(
            max(1, (os.cpu_count() or 1) // actors), self.args.num_envs
        )

    def begin(self, details: str, player):
        """The header line (`details`: the preset, the splits, ...), the clock and the progress
        line. `player`: (policy, initial_core), the script's evaluation policy (see
        evaluation.evaluate), which --eval-interval's evaluations and the final one play; a
        resumed run first plays the evaluations its checkpoint had not."""
        self.player = player
        variant = "" if self.args.exp_name == Path(self.script).stem else f" ({self.args.exp_name})"
        name = os.path.basename(self.script) + variant
        resumed = f" resumed at step {self.start_step}:" if self.start_step else ""
        print(
            f"{name}: {self.args.env_id} ({details}),{resumed} "
            f"{self.num_updates - self.start_update} "
            f"updates of {devices.describe_batch(self.args)} -> "
            f"{self.run_dir or 'the run folder of process 0'}",
            flush=True,
        )
        processes = jax.process_count()  # sampled: as if every process sampled at this one's pace
        self.progress = Progress(
            self.args.total_timesteps,
            lambda: (self.start_step + int(self.sampled.sum()) * processes, self.global_step),
            learning_from=self.start_step + getattr(self.args, "learning_starts", 0),
        )
        self.start_time = time.time()
        if self.periodic is not None:
            self.periodic.player = player
            if self.periodic.pending and self.periodic.background:
                self.periodic.start()
            elif self.periodic.pending:
                self.periodic.play_pending(self.signals.received)

    @property
    def stop(self) -> threading.Event:
        return self.signals.stop

    def elapsed(self) -> float:
        """Seconds since `begin`."""
        return time.time() - self.start_time

    def should_stop(self, stopped: bool, episodes=()) -> bool:
        """Once per update, before it, in every process (in lockstep: devices.agree): whether the
        run stops now (a signal, an error, `stopped` here or in another process). The games of
        every process are logged: `episodes`, those the update's rollouts (or chunks) carry."""
        stop, games = devices.agree(self.signals.received, stopped, list(episodes))
        self.log_episodes(self.global_step, games)
        return stop or self.paused

    @property
    def paused(self) -> bool:
        """Whether --pause-at stops the run before its last update."""
        return 0 < self.args.pause_at <= self.global_step and self.updates < self.num_updates

    def log_episodes(self, step: int, episodes):
        """Each game at its own step (TensorBoard keeps one value a step): the k games reported
        together at `step` (they ended within the rollouts that led to it) at the k steps up to
        it."""
        with self.episode_lock:
            for i, (_, ret, length) in enumerate(episodes):
                step_i = max(step - len(episodes) + 1 + i, self.last_episode_step + 1)
                self.last_episode_step = step_i
                self.progress.returns.append(ret)
                self.logger.log(
                    step_i, {"charts/episodic_return": ret, "charts/episodic_length": length}
                )

    def learned(self, state: dict, diagnostics: dict, timing: dict, extra=None) -> dict:
        """After an update: FloatingPointError for a non-finite loss or parameters; else count the
        batch, keep `state` (with its global step) for checkpoints, log the update's scalars on a
        schedule fixed by the budget alone (the run's first update, every --log-frequency, the last
        of --total-timesteps: a stop and resume logs what the uninterrupted run logs), and
        checkpoint every --save-interval."""
        update_idx, self.updates = self.updates, self.updates + 1
        if not diagnostics["finite"]:
            raise FloatingPointError(f"non-finite loss or parameters at update {update_idx}")
        self.global_step += self.batch_size
        self.state = dict(state, global_step=self.global_step)
        if self.pool is not None:  # --self-play: a snapshot every --opponent-snapshot-interval
            self.pool.add(update_idx + 1, state["params"])
        if self.periodic is not None and update_idx + 1 < self.num_updates:  # the last: finish's
            self.periodic.published(
                update_idx + 1,
                self.global_step - self.batch_size,
                self.global_step,
                state["params"],
                self.signals.received,
            )
        self.signals.started.set()
        scalars = {
            k if "/" in k else f"losses/{k}": v
            for k, v in diagnostics.items()
            if k not in ("finite", "learning_rate")
        }
        scalars.update(extra or {})
        scalars["charts/learning_rate"] = diagnostics["learning_rate"]
        scalars["charts/SPS"] = (self.global_step - self.start_step) / self.elapsed()
        scalars.update({f"timing/{k}_seconds": v for k, v in timing.items()})
        self.progress.updated(self.global_step)
        warning = None if self.warned else stale_warning(scalars, self.args)
        if warning:
            self.warned = True
            print(warning, file=sys.stderr, flush=True)
        if (
            update_idx == 0
            or (update_idx + 1) % self.args.log_frequency == 0
            or update_idx + 1 == self.num_updates
        ):
            self.logger.log(self.global_step, scalars)
        if self.args.save_interval and (update_idx + 1) % self.args.save_interval == 0:
            self.save()
        return self.state

    def journal_for(self, action_space) -> list:
        """An on-policy script with --deterministic, in one process: keep the journal of its actions
        (journal.Keeper); on resume, its actor threads' `resume` (else None each), whose envs are
        then seeded as the run's were, to be stepped back where it stopped. Call before actors()."""
        threads = devices.actor_threads(self.args)
        if not (self.args.deterministic and jax.process_count() == 1):
            return [None] * threads
        shape = (self.args.num_steps, devices.local_envs(self.args), *action_space.shape)
        # --resume A --run-dir B
        elsewhere = self.source and not folders.same_folder(self.source, self.run_dir)
        self.keeper = journal.Keeper(
            self.run_dir,
            (self.payload or {}).get("carry"),
            self.start_update,
            shape,
            action_space.dtype,
            threads,
            lambda params: devices.replicated(self.mesh, params),
            action_space,
            self.source if elsewhere else None,
        )
        self.env_seed = self.args.seed
        return [self.keeper.resumption(i) for i in range(threads)]

    def journaled(self, actions, memories, published):
        """Before an update, with a journal: its actions, the actors' states after it, the
        parameters by version."""
        if self.keeper is not None:
            self.keeper.kept(actions, memories, published)

    def save(self):
        carry = self.keeper and self.keeper.carry(
            int(self.state["policy_version"]), getattr(self.args, "actor_lag", 0) or 0
        )
        with self.saving:
            checkpoints.save_checkpoint(
                self.checkpoint_file,
                self.state,
                self.args,
                self.normalizer,
                self.script,
                carry,
                self.pool,
                self.periodic,
            )

    def wait(self, learner: threading.Thread):
        """The main thread, while the threads train: until the learner ends or the run stops; then
        every thread is stopped and joined (with many processes the learner may first finish an
        update and agree with the others to stop)."""
        try:
            while learner.is_alive() and not self.stop.is_set():
                learner.join(timeout=0.2)
        finally:
            self.threads.join(5 if jax.process_count() == 1 else 60)

    def finish(self) -> int:
        """After training: the errors, the checkpoint (not after a non-finite
        loss: the last good one stays), the closing lines, the evaluations --eval-interval's thread
        left, the final evaluation with `begin`'s player (see evaluation.evaluate), the exit
        code."""
        self.progress.close()
        if self.periodic is not None:  # its thread has seen `stop`; what it left is pending
            self.periodic.join()
        self.peer_lost = any(devices.peer_failure(error) for _, error, _ in self.threads.errors)
        if not threads.report_errors(
            self.threads.errors, self.checkpoint_file, self.global_step, self.args.env_id, self.lock
        ):
            self.save()
        if self.threads.errors:
            return 1
        print(self.progress.line(), flush=True)
        received = self.signals.received
        if received:
            print(
                f"stopped by signal {received[0]} at step {self.global_step}; checkpoint: "
                f"{self.checkpoint_file}",
                file=sys.stderr,
            )
            return 128 + received[0]
        if self.paused:  # --pause-at: its evaluations logged, then saved again without them
            where = f"--pause-at {self.args.pause_at}); checkpoint: {self.checkpoint_file}"
            print(f"paused at step {self.global_step} ({where}", flush=True)
            if self.periodic is not None and self.periodic.pending:
                if not self.periodic.play_pending(received):
                    return self.stopped_in_evaluation(0)
                self.save()
            return 0
        if self.progress.returns:
            print(
                f"final: mean return over the last {len(self.progress.returns)} episodes "
                f"{np.mean(self.progress.returns):.2f}"
            )
        if not (self.args.eval_episodes and self.run_dir):  # process 0 evaluates
            return 0
        if self.periodic is not None and not self.periodic.play_pending(received):
            return self.stopped_in_evaluation(0)
        video_dir = os.path.join(self.run_dir, "videos") if self.args.capture_video else None
        print(f"eval: playing {self.args.eval_episodes} episodes with the final policy", flush=True)
        # evaluated on an actor device
        params = devices.to_actor(self.actor_devices[0], self.state["params"])
        start, (policy, initial_core) = time.time(), self.player
        scores = evaluation.evaluate(
            policy,
            params,
            initial_core,
            self.args,
            self.normalizer,
            self.args.eval_episodes,
            video_dir,
            signals=received,
        )
        if received:
            return self.stopped_in_evaluation(len(scores))
        evaluation.log_scores(
            self.logger, self.global_step, self.updates, scores, time.time() - start, final=True
        )
        return 0

    def stopped_in_evaluation(self, episodes: int) -> int:
        signal = self.signals.received[0]
        where = f"after {episodes} episodes; checkpoint: {self.checkpoint_file}"
        print(f"evaluation stopped by signal {signal} {where}", file=sys.stderr)
        return 128 + signal


def stale_warning(scalars: dict, args):
    """The warning line for an update that masked out most of its transitions as older than
    --max-policy-lag (the loss then learns from a fraction of the batch), else None."""
    stale = scalars.get("async/stale_fraction", 0)
    if stale > 0.5:
        return (
            f"warning: {stale:.0%} of the update's transitions were older than --max-policy-lag "
            f"{args.max_policy_lag} and masked out; raise it"
        )
    return None


def prepare(args, resolve, resumed: bool):
    """Resolve and check the flags (`resolve`: the script's), make one env of the task (probe) and
    pick the devices: (args, actor devices, the learner's mesh). UsageError for a bad flag; with
    many processes, in every process if one has one, or if their flags differ
    (devices.agree_on_flags)."""
    error = actor_devices = mesh = None
    try:
        args = resolve(args)
        probe(args.env_id)  # one env made, or envpool's error in one line
        devices.use_compile_cache(args.compile_cache)
        convolution.use(args.conv)  # the pixel torsos' form, at their trace
        actor_devices, mesh = devices.make_mesh(args)
        if jax.process_index() == 0:  # it alone writes the folder
            folders.check(args, resumed)
    except UsageError as e:
        error = e
    error = devices.agree_on_flags(args, error)
    if error is not None:
        raise error
    return args, actor_devices, mesh


def probe(env_id: str):
    """Make one env of an envpool task and close it: UsageError with envpool's own error in one line
    where it cannot (a data file its package lacks: Sudoku-v0's database), before a folder or a
    compile."""
    if env_id not in tasks.USER_ENVS:  # a user's env was made already (tasks.user_maker)
        try:
            tasks.make_env(env_id, 1, 0, 1, train=True).close()
        except Exception as e:
            raise UsageError(
                f"--env-id {env_id} cannot be made here: envpool says "
                f"{(str(e) or type(e).__name__).splitlines()[0]}"
            ) from None


def checked(args):
    """`args`, once they pass the checks that every script's flags take: the ranges declared in
    Args (flags.check_bounds), --norm-obs on a task with float observations, --track with wandb
    installed, a budget of at least one update. UsageError, one line, for the first that fails."""
    check_bounds(args)
    if args.eval_episodes is None:
        self_play = getattr(args, "self_play", False)
        args = dataclasses.replace(args, eval_episodes=1000 if self_play else 10)
    if args.eval_interval and not args.eval_episodes:
        raise UsageError(
            f"--eval-interval {args.eval_interval} evaluates --eval-episodes games, and "
            "--eval-episodes is 0: pass a number of episodes, or leave --eval-interval out"
        )
    leaves = jax.tree.leaves(tasks.space_tree(tasks.spaces(args.env_id)[0]))
    if getattr(args, "norm_obs", False) and not any(
        np.issubdtype(s.dtype, np.floating) for s in leaves
    ):
        raise UsageError(
            f"--norm-obs is for float observations; {args.env_id} has none: pass --norm-obs False"
        )
    if args.track and importlib.util.find_spec("wandb") is None:
        raise UsageError(
            "--track logs to Weights & Biases, which is not installed: pip install wandb"
        )
    if getattr(args, "self_play", False):
        selfplay.check_args(args)
    if args.deterministic:
        args = check_deterministic(args)
    if args.total_timesteps < devices.global_envs(args) * args.num_steps:
        raise UsageError(
            f"--total-timesteps {args.total_timesteps} is less than one update "
            f"({devices.describe_batch(args)})"
        )
    return args


def check_deterministic(args):
    """`args` as --deterministic runs them: on a fixed schedule (an --actor-lag; 1 where none is
    given), at lag 0 one split, else UsageError; several actor threads that share a normaliser
    take it in turns (normalize.InTurn). The synchronous baseline and --serial (the replay scripts'
    loop) are deterministic as they are."""
    if not hasattr(args, "actor_lag") or getattr(args, "serial", False):
        return args
    # the free-running actor has no schedule: Cleanba's, one update behind
    if args.actor_lag is None:
        print(
            "note: --deterministic acts on a fixed schedule, and --actor-lag None has none: "
            "--actor-lag 1"
        )
        args = dataclasses.replace(args, actor_lag=1)
    if args.actor_lag == 0 and args.num_splits > 1:
        raise UsageError(
            "--actor-lag 0 acts on a rollout once every env has finished the one before, so no "
            "split steps meanwhile, and with --deterministic none may: pass --num-splits 1"
        )
    return args
