"""Scoring a policy: full games (no life-loss ends, unclipped rewards) with the script's own
policy, as `cleanrl_utils.evals` plays a script's `Model`; optionally a video of one game.
"""

import copy
import os
import sys
import threading
import time
import warnings

import jax
import numpy as np

from jax_async_rl import checkpoints, folders, selfplay
from jax_async_rl.flags import UsageError
from jax_async_rl.tasks import EpisodeStats, env_action, env_kind, make_env


def evaluate(
    policy,
    params,
    initial_core,
    args,
    normalizer,
    num_episodes: int,
    video_dir=None,
    signals=(),
    opponents=None,
    seats=None,
):
    """Play `num_episodes` full games; return the scores (game scores: all lives, raw rewards).

    `policy(params, obs, core, key, env_ids, steps)` -> (actions, their log-probs, values, the
    core's state): the script's jitted policy step (env_ids, steps: each env's index and step);
    `initial_core(n)` the recurrent core of n envs before their first step (None without one).
    Each env plays at most its share of the episodes, so that short games are not favoured. With
    `video_dir`, the first episode of the first env is written to an mp4 there. Stops early, with
    the scores so far and no video, once `signals` (the main thread's received signals) fills.
    A multi-player game (--self-play's) is played from alternating seats against `opponents`
    (selfplay.Opponents; None: the uniform random player), and its results printed by seat (and
    appended to the list `seats`: (opponent kind, the learner's place, its reward) a scored game).
    """
    num_envs = envs_for(num_episodes)
    quota = np.full(num_envs, -(-num_episodes // num_envs))
    kind = env_kind(args.env_id)
    render = video_dir is not None and kind not in ("mujoco", "dm_control", "pgx")
    rendering = {"render_mode": "rgb_array"} if render else {}
    extra = dict(rendering, **({"opponents": opponents} if opponents else {}))
    envs = make_env(args.env_id, num_envs, args.seed + 10_000, 1, train=False, **extra)
    key = jax.random.PRNGKey(args.seed + 10_000)
    stats = EpisodeStats(num_envs)
    obs, info = envs.reset()
    core, done, lives = initial_core(num_envs), np.zeros(num_envs, bool), info.get("lives")
    scores, seated = [], []  # seated: (opponent, place, reward) of a multi-player game's scores
    frames = []
    video_episode = None
    env_ids = np.arange(num_envs)
    steps = np.zeros(num_envs, np.int64)
    while len(scores) < num_episodes and not signals:
        if render and quota[0] == -(-num_episodes // num_envs):
            frames.append(envs.render()[0])
        action, _, _, state = policy(
            params, normalizer.observe(obs, train=False), core, key, env_ids, steps
        )
        steps += 1
        core = None if core is None else (state, done)  # --lstm: after an episode's end, one starts
        obs, reward, terminated, truncated, info = envs.step(
            env_action(np.asarray(action), envs.action_space)
        )
        done = terminated | truncated
        # Atari: as in training (episodic life), each life lost resets the LSTM
        if lives is not None:
            done, lives = done | (info["lives"] < lives), info["lives"]
        # a reset's: undefined (dm_control)
        reward = np.where(info["elapsed_step"] > 0, reward, 0.0)
        stats.update(np.arange(num_envs), reward, terminated, truncated, info)
        finished = stats.pop()
        games = selfplay.outcomes(envs) or [None] * len(finished)  # a multi-player game's
        for (env, ret, _), game in zip(finished, games, strict=True):
            if quota[env] > 0:
                if env == 0 and video_episode is None:
                    video_episode = len(scores)
                scores.append(ret)
                seated.append(game)
                quota[env] -= 1
    fps = frame_rate(args.env_id, envs) if render else 30.0
    if hasattr(envs, "illegal"):  # --self-play: by the learner's place in the turn order
        against = "the uniform random player" if envs.opponents is None else "the opponent"
        print(
            f"eval: against {against}, {selfplay.summary(seated[:num_episodes], envs.players)}; "
            f"illegal moves: {envs.illegal}",
            flush=True,
        )
    envs.close()
    if seats is not None:
        seats.extend(game for game in seated[:num_episodes] if game is not None)
    if signals:
        return scores
    if video_episode is not None and video_episode >= num_episodes:  # it ended past the count
        video_episode = None
    if render and frames:
        import imageio

        # Named by the game scores[i] lists; "unlisted": one cut off by the episode count.
        path = os.path.join(
            video_dir, f"eval_episode_{'unlisted' if video_episode is None else video_episode}.mp4"
        )
        try:
            os.makedirs(video_dir, exist_ok=True)
            with warnings.catch_warnings():  # JAX warns of any fork; ffmpeg's fork + exec is safe
                warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
                imageio.mimsave(path, frames, fps=fps, macro_block_size=1)
        except OSError as e:
            print(
                f"warning: no video written ({e.strerror or e}: {e.filename or path})",
                file=sys.stderr,
            )
    elif video_dir is not None and kind == "pgx":
        print(
            "warning: envpool does not render its board games and poker; no video written",
            file=sys.stderr,
        )
    elif video_dir is not None:
        print(
            "warning: MuJoCo rendering needs an OpenGL backend (set MUJOCO_GL); no video written",
            file=sys.stderr,
        )
    return scores[:num_episodes]


def envs_for(num_episodes: int) -> int:
    """The evaluation's envs: the most, up to 16, that share the games evenly (10 games: one each,
    not two in turn; 1,000: 100 each, so that alternating seats stay even), else 8 (or fewer)."""
    even = max(d for d in range(1, 17) if num_episodes % d == 0)
    return even if even >= 8 or even == num_episodes else min(num_episodes, 8)


def frame_rate(env_id: str, envs) -> float:
    """Frames a second of real play for a video of one env step a frame: Atari's 60 Hz over its
    frame skip; else the Gymnasium env's own `render_fps` (a user's env: its metadata); else 30."""
    if env_kind(env_id) == "atari":
        return 60 / envs.spec.config.frame_skip
    if getattr(envs, "metadata", {}).get("render_fps"):  # a user's Gymnasium env says it
        return float(envs.metadata["render_fps"])
    try:
        import gymnasium

        creator = gymnasium.envs.registration.load_env_creator(gymnasium.spec(env_id).entry_point)
        return float(creator.metadata["render_fps"])
    except Exception:
        return 30.0


class Periodic:
    """--eval-interval's evaluations during training (rlpyt's offline evaluation): the parameters
    of the update that crosses each multiple of the interval, played for --eval-episodes full games
    by `evaluate` with the script's evaluation policy and the normaliser's statistics of that
    update, logged at that update's env step (eval/episodic_return, _std, eval/episodes,
    eval/seconds, eval/update). The run's last update is left to the final evaluation, which logs
    the same tags: the curve's last point.

    `background` (the asynchronous scripts): a thread plays them beside the actor and the learner,
    which only copies the parameters to the host; while SLOTS evaluations wait, the learner waits
    too (said once). Otherwise (sync, --serial, --deterministic) they are played where `published`
    is called, between updates. An evaluation not logged yet is pending: the checkpoint holds the
    pending ones (`state`), and a resume plays them first (`restore_pending`), unless metrics.jsonl
    has them already: a resume neither repeats nor skips a point."""

    SLOTS = 2

    def __init__(self, args, normalizer, logger, device, threads, pending=()):
        """`threads`: the run's (its stop and its errors); `pending`: the evaluations a resumed
        checkpoint held (`restore_pending`), less those metrics.jsonl logs already."""
        self.args, self.interval = args, args.eval_interval
        self.player = None  # (policy, initial_core): `evaluate`'s, given once the script has it
        self.normalizer, self.logger, self.device = normalizer, logger, device
        self.stop, self.errors = threads.stop, threads.errors
        self.background = asynchronous(args)
        logged = folders.logged_steps(logger.run_dir, "eval/episodic_return")
        # (step, update, host parameters, normaliser state), oldest first
        self.pending = [item for item in pending if item[0] not in logged]
        self.changed = threading.Condition()
        self.thread = None
        self.warned, self.played = False, 0

    def due(self, step_before: int, step: int) -> bool:
        """Whether the update from `step_before` to `step` crosses a multiple of the interval."""
        return step // self.interval > step_before // self.interval

    def published(self, update: int, step_before: int, step: int, params, signals=()):
        """After update number `update` (its parameters `params`, the env step `step`): keep it
        if it is an evaluation's, and play what is pending (inline) or hand it to the thread."""
        if not self.due(step_before, step):
            return
        host = jax.tree.map(np.array, jax.device_get(params))  # a copy: updates donate theirs
        item = (step, update, host, copy.deepcopy(self.normalizer.state()))
        with self.changed:
            while self.background and len(self.pending) >= self.SLOTS and not self.stop.is_set():
                if not self.warned and self.played:  # the first one compiles: not said
                    self.warned = True
                    print(
                        f"warning: evaluations ({self.args.eval_episodes} episodes each) take "
                        f"longer than --eval-interval {self.interval} steps of training: the "
                        "learner waits for them; raise --eval-interval or lower --eval-episodes",
                        file=sys.stderr,
                        flush=True,
                    )
                self.changed.wait(0.1)
            self.pending.append(item)
            self.changed.notify_all()
        if self.background:
            self.start()
        else:
            self.play_pending(signals)

    def start(self):
        """The evaluator thread, once (it plays what is pending, in order, until the run stops)."""
        if self.thread is None:
            self.thread = threading.Thread(target=self.loop, name="evaluator", daemon=True)
            self.thread.start()

    def loop(self):
        try:
            while not self.stop.is_set():
                with self.changed:
                    if not self.pending:
                        self.changed.wait(0.1)
                        continue
                if not self.play(self.pending[0], Stopping(self.stop)):
                    return
        except BaseException as e:  # recorded as a thread's error: the run stops and reports it
            import traceback

            self.errors.append(("the evaluator thread", e, traceback.format_exc()))
            self.stop.set()

    def play_pending(self, signals=()) -> bool:
        """Play what is pending, here, in order; False if `signals` stopped one (it stays)."""
        while self.pending:
            if not self.play(self.pending[0], signals):
                return False
        return True

    def join(self):
        """Wait for the thread to end (the run has set `stop`); what it had not logged stays
        pending."""
        if self.thread is not None:
            self.thread.join()

    def play(self, item, signals) -> bool:
        """Evaluate one pending item and log it; False (nothing logged) if `signals` stopped it."""
        step, update, params, norm = item
        start = time.time()
        normalizer = copy.copy(self.normalizer)  # with the statistics of that update, read only
        normalizer.load(dict(norm))
        policy, initial_core = self.player
        scores = evaluate(
            policy,
            jax.device_put(params, self.device),
            initial_core,
            self.args,
            normalizer,
            self.args.eval_episodes,
            signals=signals,
        )
        if signals:
            return False
        log_scores(self.logger, step, update, scores, time.time() - start)
        with self.changed:
            assert self.pending[0] is item  # played in order, removed here alone
            self.pending.pop(0)
            self.played += 1
            self.changed.notify_all()
        return True

    def state(self) -> dict:
        """{"evaluations": the pending ones (steps, updates, parameters and normaliser statistics
        stacked)} for the checkpoint; {} when none is."""
        with self.changed:
            items = list(self.pending)
        if not items:
            return {}
        return {
            "evaluations": {
                "steps": np.array([item[0] for item in items], np.int64),
                "updates": np.array([item[1] for item in items], np.int64),
                "params": jax.tree.map(lambda *x: np.stack(x), *[item[2] for item in items]),
                "norm": jax.tree.map(lambda *x: np.stack(x), *[item[3] for item in items]),
            }
        }


def asynchronous(args) -> bool:
    """Whether the run's actors and learner run apart (an actor lag; not --serial): its
    evaluations then have a thread of their own. --deterministic plays them between updates,
    where its scores and their place in the logs are fixed."""
    serial = getattr(args, "serial", False)
    return hasattr(args, "actor_lag") and not serial and not args.deterministic


def restore_pending(stored, params, normalizer, global_step: int, path: str) -> list:
    """A checkpoint's pending evaluations (`stored`: its raw "evaluations", or None) as Periodic's
    items, in the structure of `params` and of the normaliser's statistics. UsageError, one line,
    for an entry that is not what a run writes: its steps integers in (0, `global_step`], its
    updates positive, 64 at most."""
    if stored is None:
        return []
    malformed = UsageError(f"--resume: {path}: its pending evaluations are malformed")
    try:
        count = len(stored["steps"])
        keys = set(stored)
    except Exception:
        raise malformed from None
    if not 0 < count <= 64 or keys != {"steps", "updates", "params", "norm"}:
        raise malformed
    template = {
        "steps": np.zeros(count, np.int64),
        "updates": np.zeros(count, np.int64),
        "params": jax.tree.map(lambda x: np.stack([x] * count), jax.device_get(params)),
        "norm": jax.tree.map(lambda x: np.stack([x] * count), normalizer.state()),
    }
    restored = checkpoints.load_checkpoint({"state": stored}, template, path)
    steps, updates = np.asarray(restored["steps"]), np.asarray(restored["updates"])
    if (
        steps.dtype.kind not in "iu"
        or updates.dtype.kind not in "iu"
        or steps.shape != (count,)
        or updates.shape != (count,)
        or not ((steps > 0) & (steps <= global_step) & (updates > 0)).all()
    ):
        raise UsageError(
            f"--resume: {path}: its pending evaluations' steps are not those of the run's updates"
        )
    return [
        (
            int(steps[i]),
            int(updates[i]),
            *jax.tree.map(lambda x, i=i: np.asarray(x[i]), (restored["params"], restored["norm"])),
        )
        for i in range(count)
    ]


class Stopping:
    """True once `event` is set: `evaluate`'s `signals` for the evaluator thread."""

    def __init__(self, event):
        self.event = event

    def __bool__(self):
        return self.event.is_set()


def log_scores(logger, step: int, update: int, scores, seconds: float, final: bool = False):
    """An evaluation's tags at `step` (its parameters'), and its line on stdout."""
    mean, std = float(np.mean(scores)), float(np.std(scores))
    logger.log(
        step,
        {
            "eval/episodic_return": mean,
            "eval/episodic_return_std": std,
            "eval/episodes": len(scores),
            "eval/seconds": seconds,
            "eval/update": update,
        },
    )
    where = "" if final else f" at step {step} (update {update})"
    print(f"eval{where}: {len(scores)} episodes, return {mean:.2f} +- {std:.2f}", flush=True)
