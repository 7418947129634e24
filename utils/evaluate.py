"""Score a checkpoint: play N full games with the policy a run saved, with the script that wrote it.

The checkpoint names its script (`ppo_sync_baseline.py`, `appo_envpool.py`, ..., or a user's
copy of one, renamed and edited). A checkpoint is data, and may come from anyone: this tool
imports the repository's script of that name, or the file `--script` names (a copy of yours),
never a file the checkpoint points to or one found next to it, and makes a user's Gymnasium env
(`--env-id module:callable`, `--env-module`) only with `--trust-env-module`. It rebuilds the
script's `Args` from the stored config, builds the network, normaliser and state template with the
script's `build`, restores them, and plays with the script's own policy (`make_policy_step`) through
the run library's evaluation: game scores (unclipped rewards over all lives), as at the end of
training.

It plays the run's own evaluation policy, as at the end of training, and says which: actions
sampled from the policy (the PPO family; `--greedy`: the most likely action instead), ε-greedy
at ε 0.001 (DQN), the deterministic policy (SAC, TD3), from the script's `EVAL_POLICY`.

Usage:
    python utils/evaluate.py runs/<run>/                     # 10 episodes -> <run>/eval.json
    python utils/evaluate.py runs/<selfplay run>/ --opponent runs/<other>/ --games 1000
    python utils/evaluate.py runs/<run>/checkpoint.msgpack --episodes 30 --greedy --video
"""

import dataclasses
import functools
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import jax
import numpy as np
import tyro

from jax_async_rl import checkpoints, evaluation, folders, selfplay
from jax_async_rl.checkpoints import CHECKPOINT
from jax_async_rl.flags import UsageError, describe_os_error, run_tool, stored_flags

REPO_ROOT = Path(__file__).resolve().parent.parent
# What a training script offers that this tool calls (the scripts' shared interface): the policy
# from make_policy_step and zero_core (the PPO family), or from evaluation_player (the replay
# family).
INTERFACE = ("Args", "resolve_args", "build")
POLICY_INTERFACES = (("make_policy_step", "zero_core"), ("evaluation_player",))
# Flags that earlier versions of the scripts had and that do not matter for playing.
RETIRED = ("xla_actor",)


@dataclass
class EvalArgs:
    """Score a run's checkpoint with the evaluation of the script that wrote it."""

    run: Annotated[tyro.conf.Positional[str], tyro.conf.arg(metavar="RUN")]
    """run folder (holding checkpoint.msgpack) or the checkpoint file itself"""
    episodes: int = 10
    """number of full games (episodes) to play"""
    greedy: bool = False
    """the PPO family: play the most likely action (the mean for continuous actions) instead of
    sampling (the replay family's evaluation policy is its own: DQN's ε-greedy, SAC's and TD3's
    deterministic policy)"""
    video: bool = False
    """record an mp4 of the first episode under {run}/videos/evaluate__{timestamp}/"""
    seed: Annotated[
        Optional[int], tyro.conf.arg(help_behavior_hint="(default: the run's seed)")
    ] = None
    """seed of the evaluation (the script plays with seed + 10000)"""
    out: Annotated[
        Optional[str], tyro.conf.arg(help_behavior_hint="(default: {run}/eval.json)")
    ] = None
    """JSON file for the result"""
    script: Annotated[
        Optional[str], tyro.conf.arg(help_behavior_hint="(default: the repository's of its name)")
    ] = None
    """the training script to evaluate with (your copy of one); by default the repository's script
    of the name the checkpoint records"""
    trust_env_module: bool = False
    """make the run's own Gymnasium env (--env-id module:callable, --env-module), which imports
    that module: only for a run folder whose author you trust"""
    opponent: Annotated[Optional[str], tyro.conf.arg(help_behavior_hint="(default: random)")] = None
    """a --self-play run's opponents in the other seats: "random" (the uniform random legal
    player), or another run of the task with the same network, of any script that self-plays
    (its folder or checkpoint: its final parameters; PATH@VERSION: the snapshot of that version in its opponent pool, RUN@VERSION for
    the run's own); the seats alternate, and the results are printed by seat"""
    games: Optional[int] = None
    """the number of games, as --episodes (the word for a multi-player game)"""


def find_script(payload: dict, path: str, override: Optional[str]) -> Path:
    """The file of the script to play the checkpoint at `path` with: `override` (--script), else
    the repository's script of the recorded name. Never the path the checkpoint records, nor a
    file next to it: whoever wrote the checkpoint wrote those too, and importing runs them."""
    if override is not None:
        if not os.path.isfile(override):
            raise UsageError(f"--script {override}: no such file")
        return Path(override)
    name, recorded = payload["script"], payload.get("script_path")
    if (REPO_ROOT / name).is_file():  # read_checkpoint: a file name, no folder
        return REPO_ROOT / name
    where = f" (recorded at {recorded})" if isinstance(recorded, str) else ""
    raise UsageError(
        f"{path} was written by {name}{where}, which is not a script of this repository; "
        f"evaluate.py "
        "imports only those, or the file --script names: pass --script PATH if you trust it"
    )


def load_training_script(script: Path):
    """The imported script; UsageError if it lacks the interface this tool calls."""
    module = checkpoints.load_script(script)
    missing = [name for name in INTERFACE if not hasattr(module, name)]
    if not any(all(hasattr(module, name) for name in names) for names in POLICY_INTERFACES):
        missing += [name for name in POLICY_INTERFACES[0] if not hasattr(module, name)]
    if missing:
        raise UsageError(
            f"{script} does not follow the training scripts' interface (no {', '.join(missing)})"
        )
    return module


def rebuild_args(module, config: dict, path: str):
    """The script's resolved Args: its defaults replaced by every field of the stored config."""
    fields = {f.name for f in dataclasses.fields(module.Args)}
    config = {k: v for k, v in config.items() if k not in RETIRED}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise UsageError(
            f"{path}: its config has fields that {module.__name__}.py's Args lacks "
            f"({', '.join(unknown)}); "
            "it was written by another version of the script"
        )
    config = stored_flags(
        module.Args, config, path
    )  # of the types and in the ranges its Args declares
    # Written before normalisation existed: nothing was normalised (not today's preset).
    config = {
        **{k: False for k in ("norm_obs", "norm_reward") if k in fields},
        **config,
        "track": False,
        "resume": None,
    }
    # Evaluation plays with one actor in one process and learns nothing: the training run's
    # processes, devices and minibatch split (checked against them) need not fit here.
    launch = dict(
        distributed=False,
        coordinator_address="",
        num_processes=0,
        process_id=-1,
        actor_device_ids=[0],
        learner_device_ids=[0],
        num_actor_threads=1,
        num_minibatches=1,
    )
    config.update({k: v for k, v in launch.items() if k in fields})
    try:
        return module.resolve_args(dataclasses.replace(module.Args(), **config))
    except UsageError as e:
        raise UsageError(f"{path}: its config is not valid for {module.__name__}.py ({e})")


def restore(module, args, payload: dict, path: str):
    """(what the script's build returns, normalizer, params) as its main builds them, restored
    from `path`. Only the parameters and the normaliser are read: an optimiser state of another
    version of the script does not matter for playing. Every script's build returns (network,
    ..., normalizer, initial state)."""
    built = module.build(args, jax.random.PRNGKey(args.seed))
    normalizer, state = built[-2], built[-1]
    template = {"params": state["params"], **normalizer.state()}
    stored = {key: payload["state"][key] for key in template if key in payload["state"]}
    try:
        restored = checkpoints.load_checkpoint(dict(payload, state=stored), template, path)
    except UsageError as e:
        raise UsageError(str(e).removeprefix("--resume: "))
    normalizer.load(restored)
    return built, normalizer, restored["params"]


def player(module, args, built, greedy: bool):
    """(policy, initial core, the policy in words): the script's evaluation policy, as its run
    plays it at the end of training; `greedy` (the PPO family): the most likely action."""
    if hasattr(module, "evaluation_player"):  # the replay family: its evaluation policy is its own
        policy, initial_core = module.evaluation_player(args, built)
        words = (
            f"the run's own evaluation policy, "
            f"{getattr(module, 'EVAL_POLICY', 'its evaluation_player')}"
        )
        return (
            policy,
            initial_core,
            words + (" (--greedy changes nothing for it)" if greedy else ""),
        )
    network, continuous = built[0], built[2]
    policy = module.make_policy_step(network, continuous, values=False, greedy=greedy)
    words = (
        "the most likely action (the mean for continuous actions; the run's own evaluation samples)"
        if greedy
        else "the run's own evaluation policy, actions sampled from it"
    )
    return policy, functools.partial(module.zero_core, network.lstm_size), words


def opponent(module, args, cli: EvalArgs, path: str, policy):
    """(selfplay.Opponents playing --opponent, the words for it) for a --self-play run; (None,
    "") for the uniform random player. UsageError for --opponent on a one-player run, or a run
    or snapshot that is not of the same network. The opponent plays as the run does (--greedy)."""
    if cli.opponent is None:
        return None, ""
    if not getattr(args, "self_play", False):
        raise UsageError(f"--opponent: {path} is not a --self-play run")
    if cli.opponent == "random":
        return None, " against the uniform random player"
    where, at, version = cli.opponent.rpartition("@")
    if not (at and version.isdigit()):  # no snapshot named: the whole of it is a path
        where, version = cli.opponent, ""
    where = os.path.dirname(path) if where == "RUN" else where
    if not os.path.exists(where):
        raise UsageError(f"--opponent {cli.opponent}: {where} does not exist")
    other = checkpoints.checkpoint_path(where)
    payload = checkpoints.read_checkpoint(other)
    if version:
        payload = dict(payload, state={"params": snapshot(payload, int(version), cli.opponent)})
    _, _, params = restore(module, args, payload, other)
    key = jax.random.PRNGKey(args.seed + 20_000)
    opponents = selfplay.Opponents(policy, key, (0.0, 1.0, 0.0), fixed=params, seed=args.seed)
    return opponents, f" against {cli.opponent}"


def snapshot(payload: dict, version: int, named: str):
    """The parameters of snapshot `version` of a checkpoint's opponent pool; UsageError, naming
    the versions kept, where it has none of that version or its pool is not one."""
    try:
        pool = payload["state"].get("opponents", {})
        versions = np.asarray(pool.get("versions", []))
        if versions.dtype.kind not in "iu" or versions.ndim != 1:
            raise ValueError(f"its versions are {versions.dtype} {versions.shape}")
        kept = [int(v) for v in versions if v >= 0]
        if version not in kept:
            raise UsageError(
                f"--opponent {named}: its pool keeps versions {', '.join(map(str, kept)) or 'none'}"
            )
        slot = versions.tolist().index(version)
        return jax.tree.map(lambda x: np.asarray(x)[slot], pool["params"])
    except (AttributeError, KeyError, IndexError, TypeError, ValueError) as e:
        raise UsageError(f"--opponent {named}: its opponent pool is not one ({e})")


def main(cli: EvalArgs) -> int:
    warnings.filterwarnings("ignore", message=".*precision lowered.*")  # gymnasium's Box casts
    if cli.games is not None:
        cli = dataclasses.replace(cli, episodes=cli.games)
    if cli.episodes <= 0:
        raise UsageError(f"--episodes must be positive, got {cli.episodes}")
    if not os.path.exists(cli.run):
        raise UsageError(
            f"{cli.run} does not exist; pass a run folder (runs/<run>/) or its {CHECKPOINT}"
        )
    path = checkpoints.checkpoint_path(cli.run)
    folders.check_files(
        os.path.dirname(os.path.abspath(path))
    )  # writes eval.json and videos/ there: no link
    payload = checkpoints.read_checkpoint(path)
    if not cli.trust_env_module:
        checkpoints.check_trusted(payload["config"], [], path, "pass --trust-env-module")
    module = load_training_script(find_script(payload, path, cli.script))
    args = rebuild_args(module, payload["config"], path)
    if cli.seed is not None:
        args = dataclasses.replace(args, seed=cli.seed)
    built, normalizer, params = restore(module, args, payload, path)
    global_step = int(payload["state"].get("global_step", 0))

    run_dir = os.path.dirname(os.path.abspath(path))
    video_dir = (
        os.path.join(run_dir, "videos", f"evaluate__{int(time.time())}") if cli.video else None
    )
    policy, initial_core, words = player(module, args, built, cli.greedy)
    opponents, against = opponent(module, args, cli, path, policy)
    own = (
        f"; the run's own evaluation played {args.eval_episodes} at the end of training"
        if args.eval_episodes
        else ""
    )
    print(
        f"{Path(module.__file__).name}: {args.env_id}, step {global_step}: {cli.episodes} "
        f"episodes with {words}{own}{against}"
    )
    seats = []
    scores = evaluation.evaluate(
        policy,
        params,
        initial_core,
        args,
        normalizer,
        cli.episodes,
        video_dir,
        opponents=opponents,
        seats=seats,
    )
    videos = (
        sorted(os.path.join(video_dir, f) for f in os.listdir(video_dir))
        if video_dir and os.path.isdir(video_dir)
        else []
    )
    result = {
        "episodes": len(scores),
        "mean": float(np.mean(scores)),
        "std": float(np.std(scores)),
        "scores": [float(s) for s in scores],
        "checkpoint": os.path.abspath(path),
        "global_step": global_step,
        "greedy": cli.greedy and not hasattr(module, "evaluation_player"),
        "policy": words,
        "script": payload["script"],
        "env_id": args.env_id,
        "seed": args.seed,
        "videos": videos,
    }
    if seats:  # a multi-player game: (opponent, the learner's place in the turn order, reward)
        result["opponent"] = cli.opponent or "random"
        result["seats"] = [{"place": place, "reward": reward} for _, place, reward in seats]
    out = cli.out or os.path.join(run_dir, "eval.json")
    print(
        f"return over {len(scores)} episodes: {result['mean']:.2f} +- {result['std']:.2f}",
        flush=True,
    )
    for video in videos:
        print(f"video: {video}")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        checkpoints.write_atomically(out, json.dumps(result, indent=2).encode())
    except OSError as e:
        print(
            f"error: the result was not written ({describe_os_error(e)}); the score is above; "
            "pass --out FILE to keep it",
            file=sys.stderr,
        )
        return 1
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    run_tool(main, EvalArgs)
