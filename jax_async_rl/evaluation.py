"""Scoring a policy: full games (no life-loss ends, unclipped rewards) with the script's own
policy, as `cleanrl_utils.evals` plays a script's `Model`; optionally a video of one game.
"""

import os
import sys
import warnings

import jax
import numpy as np

from jax_async_rl import selfplay
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
    num_envs = min(num_episodes, 8)
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
