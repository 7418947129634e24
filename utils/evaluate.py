"""Score a checkpoint: play N full games with the policy a run saved, with the script that wrote it.

The checkpoint names its script (`ppo_sync_baseline.py`, `appo_envpool.py` or
`impala_envpool.py`); this tool imports that script from the repository root, rebuilds its `Args`
from the stored config, builds the network and the state template as the script's `main` does,
restores them with the script's `load_checkpoint` and plays with the script's own `evaluate`:
game scores (unclipped rewards over all lives), exactly as at the end of training.

Usage:
    python utils/evaluate.py runs/<run>/                     # 10 sampled episodes -> <run>/eval.json
    python utils/evaluate.py runs/<run>/checkpoint.msgpack --episodes 30 --greedy --video
"""

import dataclasses
import json
import os
import time
import warnings
from dataclasses import dataclass
from typing import Annotated, Optional

import envpool
import jax
import numpy as np
import tyro

from common import CHECKPOINT, UsageError, checkpoint_file, load_script, read_checkpoint, run_cli


@dataclass
class EvalArgs:
    """Score a run's checkpoint with the evaluation of the script that wrote it."""

    run: Annotated[tyro.conf.Positional[str], tyro.conf.arg(metavar="RUN")]
    """run folder (holding checkpoint.msgpack) or the checkpoint file itself"""
    episodes: int = 10
    """number of full games (episodes) to play"""
    greedy: bool = False
    """play the most likely action (the mean for continuous actions) instead of sampling"""
    video: bool = False
    """record an mp4 of the first episode under {run}/videos/evaluate__{timestamp}/"""
    seed: Optional[int] = None
    """seed of the evaluation (the script plays with seed + 10000; default: the run's seed)"""
    out: Optional[str] = None
    """JSON file for the result (default: {run}/eval.json)"""


def rebuild_args(module, config: dict, path: str):
    """The script's resolved Args: its defaults replaced by every field of the stored config."""
    fields = {f.name for f in dataclasses.fields(module.Args)}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise UsageError(
            f"{path}: its config has fields that {module.__name__}.py's Args lacks ({', '.join(unknown)}); "
            "it was written by another version of the script"
        )
    try:
        return module.resolve_args(dataclasses.replace(module.Args(), **config))
    except module.UsageError as e:
        raise UsageError(f"{path}: its config is not valid for {module.__name__}.py ({e})")


def restore(module, args, path: str):
    """(network, continuous, state) as the script's main builds them, the state read from `path`."""
    num_updates = args.total_timesteps // (args.num_envs * args.num_steps)
    spec = envpool.make_spec(args.env_id)
    action_space = spec.gymnasium_action_space if hasattr(spec, "gymnasium_action_space") else spec.action_space
    obs_space = spec.gymnasium_observation_space if hasattr(spec, "gymnasium_observation_space") else spec.observation_space
    continuous = not hasattr(action_space, "n")
    action_dim = int(np.prod(action_space.shape)) if continuous else int(action_space.n)
    network = module.ActorCritic(action_dim, continuous)
    params = network.init(jax.random.PRNGKey(args.seed), np.zeros((1, *obs_space.shape), obs_space.dtype))
    optimizer = module.make_optimizer(args, num_updates)
    template = {"params": params, "opt_state": optimizer.init(params), "global_step": 0, "policy_version": 0}
    try:
        state = module.load_checkpoint(path, template, args)
    except module.UsageError as e:
        raise UsageError(str(e).removeprefix("--resume: "))
    return network, continuous, state


def main(cli: EvalArgs) -> int:
    warnings.filterwarnings("ignore", message=".*precision lowered.*")  # gymnasium's Box casts
    if cli.episodes <= 0:
        raise UsageError(f"--episodes must be positive, got {cli.episodes}")
    if not os.path.exists(cli.run):
        raise UsageError(f"{cli.run} does not exist; pass a run folder (runs/<run>/) or its {CHECKPOINT}")
    path = checkpoint_file(cli.run)
    payload = read_checkpoint(path)
    module = load_script(payload["script"])
    args = rebuild_args(module, payload["config"], path)
    if cli.seed is not None:
        args = dataclasses.replace(args, seed=cli.seed)
    network, continuous, state = restore(module, args, path)

    run_dir = os.path.dirname(os.path.abspath(path))
    video_dir = os.path.join(run_dir, "videos", f"evaluate__{int(time.time())}") if cli.video else None
    print(f"{payload['script']}: {args.env_id}, step {int(state['global_step'])}, "
          f"{cli.episodes} {'greedy' if cli.greedy else 'sampled'} episodes")
    scores = module.evaluate(state["params"], network, args, continuous, cli.episodes, video_dir, greedy=cli.greedy)
    videos = sorted(os.path.join(video_dir, f) for f in os.listdir(video_dir)) if video_dir and os.path.isdir(video_dir) else []
    result = {
        "episodes": len(scores),
        "mean": float(np.mean(scores)),
        "std": float(np.std(scores)),
        "scores": [float(s) for s in scores],
        "checkpoint": os.path.abspath(path),
        "global_step": int(state["global_step"]),
        "greedy": cli.greedy,
        "script": payload["script"],
        "env_id": args.env_id,
        "seed": args.seed,
        "videos": videos,
    }
    out = cli.out or os.path.join(run_dir, "eval.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"return over {len(scores)} episodes: {result['mean']:.2f} +- {result['std']:.2f} -> {out}")
    for video in videos:
        print(f"video: {video}")
    return 0


if __name__ == "__main__":
    run_cli(main, EvalArgs)
