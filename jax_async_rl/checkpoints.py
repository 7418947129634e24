"""Checkpoints and what else a run wrote: saving one atomically, reading and checking one,
restoring a state from it, continuing a run with its own flags (--resume), and importing the
training script that wrote it (the tools in utils/ do).

A checkpoint is flax's msgpack of {"state": params, optimiser state, global step, policy
version and the normaliser's statistics; "config": the flags as JSON, but for the run folder and
--resume (PLACE); "script": the training script's file name; "script_path": where it was}.
"""

import dataclasses
import errno
import importlib.util
import json
import os
import stat
import sys
from pathlib import Path

import flax.serialization
import jax
import numpy as np

from jax_async_rl.flags import RETIRED, UsageError, stored_flags

CHECKPOINT = "checkpoint.msgpack"
CONFIG = "config.json"
METRICS = "metrics.jsonl"
JOURNAL = "actions.bin"  # --deterministic's actions (journal.py)
# This launch's (the machine's devices, the processes, its compile cache, what the user trusts,
# where it pauses): never restored from the run on --resume. A cache folder named by a file could hold compiled code
# someone else wrote.
LAUNCH = (
    "distributed",
    "coordinator_address",
    "num_processes",
    "process_id",
    "actor_device_ids",
    "learner_device_ids",
    "compile_cache",
    "trust_env_module",
    "pause_at",
)
# Where this launch wrote and what it resumed: not stored in a checkpoint, so that identical runs in
# two folders write identical files (docs/reproducibility.md); --resume and config.json name them.
PLACE = ("run_dir", "resume")
# What the network and its inputs were trained on: a resumed run cannot change these.
FIXED_ON_RESUME = (
    "env_id",
    "env_module",
    "env_kwargs",
    "norm_obs",
    "norm_reward",
    "lstm",
    "lstm_size",
    "self_play",  # the checkpoint holds the opponent pool, its slots set by:
    "opponent_pool_size",
)
# (the script that wrote a checkpoint, a retired flag it had on) -> the script whose job that flag
# was.
SUCCESSORS = {("appo_envpool.py", "xla_actor"): "appo_envpool_xla.py"}


def checkpoint_path(path: str) -> str:
    """A run folder or a checkpoint file -> the checkpoint file (which may not exist)."""
    return os.path.join(path, CHECKPOINT) if os.path.isdir(path) else path


def write_atomically(path: str, data: bytes):
    """Write `data` to `path` through a temporary file, fsync and rename (then fsync the folder):
    a crash mid-write keeps the old file."""
    tmp = f"{path}.tmp"
    try:
        # a kill's leftover, or a link someone planted: never written through
        if os.path.lexists(tmp):
            os.unlink(tmp)
        with os.fdopen(
            os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666
            ),
            "wb",
        ) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:  # a full disk: what was written of the new file goes, the old one stays
        if os.path.exists(tmp):
            os.remove(tmp)
        if e.filename is None:  # write, flush and fsync name no file
            e.filename = tmp
        raise
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def open_own(path: str, flags: int, mode: str, **kwargs):
    """`path` opened (os.open's `flags`, then as a file of `mode`) never through a symbolic link
    (O_NOFOLLOW), and only if it is a regular file with one name, not a hard link to a file
    elsewhere: a run folder may come from anyone, and the files a run appends to or cuts are its
    own. OSError naming the file if not."""
    # a FIFO: no wait
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        raise OSError(
            errno.EINVAL,
            "not a regular file of the run's own (a hard link, a FIFO or a device)",
            path,
        )
    os.set_blocking(fd, True)
    return os.fdopen(fd, mode, **kwargs)


def save_checkpoint(
    path: str, state: dict, args, normalizer, script: str, carry=None, pool=None, evaluations=None
):
    """The state, the normaliser's statistics (and --self-play's opponent `pool`, and
    --eval-interval's pending `evaluations`, evaluation.Periodic) and the flags of `script`'s run
    (and what a --deterministic resume needs besides: `carry`, journal.Keeper's), written
    atomically. Process 0 alone writes; the others' calls do nothing."""
    if jax.process_index():
        return
    extra = pool.state() if pool is not None else {}
    extra.update(evaluations.state() if evaluations is not None else {})
    payload = {
        "state": flax.serialization.to_state_dict(
            jax.device_get(dict(state, **normalizer.state(), **extra))
        ),
        "config": json.dumps({k: v for k, v in dataclasses.asdict(args).items() if k not in PLACE}),
        "script": os.path.basename(script),
        "script_path": os.path.abspath(script),
    }
    if carry:
        payload["carry"] = flax.serialization.to_state_dict(jax.device_get(carry))
    write_atomically(path, flax.serialization.msgpack_serialize(payload))


def finish_rename(path: str):
    """Make a complete `path`.tmp the checkpoint (the rename a kill cut off), so that the next
    save, which writes `path`.tmp anew, cannot lose it. UsageError if it is not a regular file
    (a link would become the checkpoint)."""
    if not stat.S_ISREG(os.lstat(f"{path}.tmp").st_mode):
        raise UsageError(
            f"--resume: {path}.tmp is not a regular file; a run reads and writes no link in its "
            f"folder: "
            "replace it with the file itself"
        )
    os.replace(f"{path}.tmp", path)
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def complete_tmp(path: str) -> bool:
    """Whether `path`.tmp is a whole checkpoint: one whose rename was cut off (kill -9)."""
    try:
        return os.path.isfile(f"{path}.tmp") and bool(read_checkpoint(f"{path}.tmp"))
    except UsageError:
        return False


def find_checkpoint(path: str) -> str:
    """The file to resume `path` (a run folder or a checkpoint) from: the checkpoint, else a
    complete `.tmp` of it (said on stderr). UsageError naming an incomplete one."""
    ckpt = checkpoint_path(path)
    if os.path.isfile(ckpt) or not os.path.isfile(f"{ckpt}.tmp"):
        return ckpt
    if complete_tmp(ckpt):
        print(
            f"note: no {CHECKPOINT} in {os.path.dirname(ckpt) or '.'}, but a complete "
            f"{CHECKPOINT}.tmp (the run was "
            "stopped while renaming it): resuming from it",
            file=sys.stderr,
        )
        return f"{ckpt}.tmp"
    raise UsageError(
        f"no checkpoint at {ckpt}; {ckpt}.tmp is an incomplete write (the run was killed while "
        f"saving "
        "its first checkpoint): nothing to resume; remove the folder and start again"
    )


def read_checkpoint(path: str) -> dict:
    """The payload of a checkpoint written by a training script (or a user's copy of one):
    {"state", "config" (a dict), "script" (its file name), maybe "script_path"}. UsageError if
    the file is missing, unreadable (corrupt, truncated) or not one of this project's."""
    if not os.path.isfile(path):
        raise UsageError(
            f"no checkpoint at {path}; pass a run folder holding {CHECKPOINT}, or the file itself"
        )
    try:
        with open(path, "rb") as f:
            payload = flax.serialization.msgpack_restore(f.read())
    except Exception as e:
        raise UsageError(
            f"{path} is not a readable checkpoint ({type(e).__name__}); it may be corrupt or "
            f"truncated"
        )
    missing = [
        key
        for key in ("state", "config", "script")
        if not isinstance(payload, dict) or key not in payload
    ]
    if missing:
        raise UsageError(
            f"{path} is not a checkpoint of this project (no "
            f"{', '.join(repr(k) for k in missing)} entry)"
        )
    script = payload["script"]
    if (
        not isinstance(script, str)
        or os.path.basename(script) != script
        or not script.endswith(".py")
    ):
        raise UsageError(
            f"{path} names its script as {script!r}, which is not a script's file name"
        )
    try:
        config = json.loads(payload["config"])
    except (TypeError, ValueError):
        config = None
    if (
        not isinstance(config, dict)
        or not isinstance(config.get("env_id"), str)
        or not isinstance(payload["state"], dict)
    ):
        raise UsageError(
            f"{path} has no readable config (with an env_id) or state; it is not a checkpoint of "
            f"this project"
        )
    for key in ("global_step", "policy_version"):  # counts, as every run writes them
        value = np.asarray(payload["state"].get(key, 0))
        if value.ndim or value.dtype.kind not in "iu" or value < 0:
            raise UsageError(
                f"{path} holds a {key} of {value.tolist()!r}, not a count; it is not a checkpoint "
                "a run of this project wrote"
            )
    return dict(payload, config=config)


def load_checkpoint(payload: dict, template: dict, path: str) -> dict:
    """The checkpoint's state in the structure of `template`; UsageError if it does not fit."""
    try:
        state = flax.serialization.from_state_dict(template, payload["state"])
        shapes_match = jax.tree.map(lambda a, b: np.shape(a) == np.shape(b), template, state)
    except Exception as e:
        raise UsageError(
            f"--resume: {path} does not match this network/optimiser ({e}); it needs the run's "
            f"flags and the "
            "version of the script that wrote it"
        )
    if not all(jax.tree.leaves(shapes_match)):
        raise UsageError(
            f"--resume: {path} has parameters of other shapes; use the flags of the run that "
            f"wrote it"
        )
    # A Python number of the template (a fresh run's counters) is weakly typed in JAX, and stays so
    # through every update; the file holds it as a numpy scalar. Restored as a Python number, the
    # first update after a resume is the one the fresh run compiled (and the compile cache holds).
    return jax.tree.map(
        lambda a, b: type(a)(b) if isinstance(a, (bool, int, float)) else b, template, state
    )


def resume_args(args, given, script: str):
    """With --resume: (the run's flags, those named in `given` replacing them; its checkpoint; the
    flags changed). `given`: the flags named on the command line (None: those that differ from
    Args' defaults). UsageError for a checkpoint of another script, or a flag that cannot change
    mid-run, or one the checkpoint holds of a wrong type or out of range. Without --resume: (args,
    None, {})."""
    if not args.resume:
        return args, None, {}
    try:
        path = find_checkpoint(args.resume)
        payload = read_checkpoint(path)
    except UsageError as e:
        raise UsageError(f"--resume: {e}")
    retired = [name for name in RETIRED if payload["config"].get(name)]
    heirs = {SUCCESSORS.get((payload["script"], name)) for name in retired}
    if os.path.basename(script) not in {payload["script"], *heirs}:
        raise UsageError(
            f"--resume: {path} was written by {payload['script']}, not {os.path.basename(script)}"
        )
    for name in retired:  # a run of an earlier version: its job moved, or is gone
        print(
            f"note: {path} was trained with --{name.replace('_', '-')}, which is {RETIRED[name]}; "
            f"{os.path.basename(script)} continues it",
            file=sys.stderr,
        )
    defaults = type(args)()
    fields = [f.name for f in dataclasses.fields(args) if f.name not in (*PLACE, *LAUNCH)]
    if given is None:
        given = {name for name in fields if getattr(args, name) != getattr(defaults, name)}
    given = {
        name for name in given if getattr(args, name) is not None
    }  # None (the preset): the run's own
    # A flag the run's version did not have: the value that version used (Args.UNTIL_ADDED), else
    # the default.
    until_added = {
        **{name: getattr(defaults, name) for name in fields},
        **getattr(type(args), "UNTIL_ADDED", {}),
    }
    stored = {name: payload["config"].get(name, until_added[name]) for name in fields}
    # The file's flags pass the command line's checks (their types, then their ranges), named as the
    # file's
    stored.update(
        stored_flags(
            type(args),
            {name: stored[name] for name in fields if name not in given},
            f"--resume {path}",
        )
    )
    changed = {
        name: getattr(args, name)
        for name in fields
        if name in given and getattr(args, name) != stored[name]
    }
    for name in FIXED_ON_RESUME:
        if name in changed:
            raise UsageError(
                f"--resume: --{name.replace('_', '-')} cannot change mid-run ({path} has "
                f"{stored[name]!r}); "
                "start a new run to change it"
            )
    # --no-deterministic the other way is the way out of a damaged journal
    if changed.get("deterministic"):
        raise UsageError(
            f"--resume: {path} was trained without --deterministic: what its envs and actors did "
            f"was not recorded, so "
            "a resume cannot make it reproducible; resume without it, or start a new "
            "--deterministic run"
        )
    if not getattr(args, "trust_env_module", False):
        named = env_modules(
            args.env_id if "env_id" in given else "",
            args.env_module if "env_module" in given else None,
        )
        check_trusted(
            payload["config"],
            named,
            f"--resume: {path}",
            "name it again (--{}) or pass --trust-env-module",
        )
    return (
        dataclasses.replace(args, **{name: stored[name] for name in fields if name not in given}),
        payload,
        changed,
    )


def env_modules(env_id, env_module) -> list:
    """The modules that making this env imports: --env-module, and the module of an --env-id
    module:callable (Gymnasium imports it for an id of that form too)."""
    modules = [
        env_module,
        env_id.split(":", 1)[0] if isinstance(env_id, str) and ":" in env_id else None,
    ]
    return [str(module) for module in modules if module]


def check_trusted(config: dict, named: list, where: str, allow: str):
    """UsageError, one line, if a run's recorded flags (`config`, from a file anyone may have
    written) would import an env module that the user has not named on this command line
    (`named`): opening a run folder executes nothing. `allow`: how to allow it ({} the flag)."""
    for module in env_modules(config.get("env_id"), config.get("env_module")):
        if module not in named:
            flag = (
                f"env-module {module}"
                if module == config.get("env_module")
                else f"env-id {config['env_id']}"
            )
            raise UsageError(
                f"{where} would import the module {module!r} to make its env (--{flag}), and a run "
                f"folder runs no code you did not choose: {allow.format(flag)}, if you trust it"
            )


def load_script(path):
    """Import a training script (one in the repository or a user's copy) from its file; nothing
    runs at import. UsageError if it cannot be imported."""
    path = Path(path).resolve()
    module_name = path.stem
    module = sys.modules.get(module_name)
    if module is not None and Path(getattr(module, "__file__", "")).resolve() == path:
        return module
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise UsageError(
            f"{path} cannot be imported ({type(e).__name__}: {e}); is it a training script?"
        )
    return module


def run_identity(run_dir: str) -> dict:
    """{"script", "env_id", "seed"} of a run: from config.json (script = its exp_name, which
    defaults to the script's name), else from the checkpoint (the script's file name)."""
    config_file = os.path.join(run_dir, CONFIG)
    if os.path.isfile(config_file):
        try:
            with open(config_file) as f:
                config = json.load(f)
            return {
                "script": str(config["exp_name"]),
                "env_id": str(config["env_id"]),
                "seed": config.get("seed"),
            }
        except (ValueError, KeyError, TypeError) as e:
            raise UsageError(f"{config_file} is not a run's config ({type(e).__name__}: {e})")
    ckpt = os.path.join(run_dir, CHECKPOINT)
    if not os.path.isfile(ckpt):
        raise UsageError(
            f"{run_dir} has neither {CONFIG} nor {CHECKPOINT}: which script and env wrote it is "
            f"unknown"
        )
    payload = read_checkpoint(ckpt)
    script = payload["script"][: -len(".py")]
    return {
        "script": script,
        "env_id": str(payload["config"].get("env_id")),
        "seed": payload["config"].get("seed"),
    }
