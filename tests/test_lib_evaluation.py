"""jax_async_rl.evaluation: full games with a script's policy, each env its share, a video of the
first, and an early stop on a signal."""

import imageio
import numpy as np

from jax_async_rl import evaluation
from jax_async_rl.normalize import Normalizer
from jax_async_rl.tasks import make_env


class Args:
    env_id, seed = "CartPole-v1", 3


RNG = np.random.default_rng(0)


def random_policy(params, obs, core, key, env_ids, steps):
    """A policy as a script's jitted policy_step returns: actions, log-probs, values, state."""
    return RNG.integers(0, 2, len(obs)), None, None, None


def test_evaluation_plays_whole_games_each_env_its_share_and_records_the_first(tmp_path):
    passthrough = Normalizer(np.zeros(4), 0, False, False, 0.0)
    scores = evaluation.evaluate(
        random_policy, None, lambda n: None, Args(), passthrough, 12, str(tmp_path / "videos")
    )
    assert len(scores) == 12 and all(1 <= s <= 500 for s in scores)
    assert all(s == int(s) for s in scores)  # CartPole's score is its length
    videos = list((tmp_path / "videos").glob("*.mp4"))
    assert len(videos) == 1 and videos[0].stat().st_size > 1000
    # The video is named by the game it shows (CartPole: one frame a step, its score its length),
    # at CartPole's own 50 frames a second.
    index = int(videos[0].stem.removeprefix("eval_episode_"))
    reader = imageio.get_reader(videos[0])
    frames, fps = reader.count_frames(), reader.get_meta_data()["fps"]
    reader.close()
    assert frames == scores[index] and fps == 50, (frames, fps, index, scores)
    assert evaluation.frame_rate("Pong-v5", make_env("Pong-v5", 1, 0, 1, train=False)) == 15


def test_evaluation_stops_at_once_on_a_signal_with_the_scores_so_far(tmp_path):
    passthrough = Normalizer(np.zeros(4), 0, False, False, 0.0)
    received = [15]  # the main thread's received signals: already one
    scores = evaluation.evaluate(
        random_policy,
        None,
        lambda n: None,
        Args(),
        passthrough,
        10,
        str(tmp_path / "videos"),
        signals=received,
    )
    assert scores == [] and not (tmp_path / "videos").exists()
