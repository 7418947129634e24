"""The run folder: one owner at a time (`claim`: an exclusive lock held for the run's life), the
checks before a run takes a folder, its config.json (the run's record, never rewritten, each
resume appended), and its metrics on resume (cut back to the checkpoint's step).

Process 0 of a run alone calls these: it alone writes the folder.
"""

import dataclasses
import fcntl
import itertools
import json
import os
import re
import shlex
import shutil
import socket
import stat
import sys
import time

from jax_async_rl import checkpoints
from jax_async_rl.checkpoints import CHECKPOINT, CONFIG, JOURNAL, METRICS
from jax_async_rl.flags import UsageError

LOCK = ".lock"
# The files a run writes in its folder (and their .tmp); those it appends to or cuts in place; its
# folders.
RUN_FILES = (CONFIG, CHECKPOINT, METRICS, JOURNAL, LOCK, "eval.json")
IN_PLACE = (METRICS, JOURNAL, LOCK)
RUN_FOLDERS = ("videos", "wandb")


def own_folder(args) -> str:
    """The folder a run writes: --run-dir, else a resumed run's own (None: a new folder)."""
    if args.run_dir:
        return args.run_dir
    return (
        os.path.dirname(os.path.abspath(checkpoints.checkpoint_path(args.resume)))
        if args.resume
        else None
    )


def same_folder(a, b) -> bool:
    return bool(a) and bool(b) and os.path.realpath(a) == os.path.realpath(b)


def check(args, resumed: bool):
    """UsageError if --run-dir names a file, or a folder that holds another run (a new run would
    mix its records with that run's), or if a resumed run's own folder has a damaged record (in
    start-up, so that with many processes every one stops: devices.agree_on_flags)."""
    own = resumed and same_folder(args.run_dir, own_folder(dataclasses.replace(args, run_dir=None)))
    if resumed and (not args.run_dir or own):  # the run's own folder: its record must be whole
        read_config(os.path.join(own_folder(dataclasses.replace(args, run_dir=None)), CONFIG))
    if not args.run_dir or own:
        return
    if os.path.exists(args.run_dir) and not os.path.isdir(args.run_dir):
        raise UsageError(f"--run-dir {args.run_dir} is a file, not a folder")
    ckpt = os.path.join(args.run_dir, CHECKPOINT)
    if os.path.exists(ckpt) or checkpoints.complete_tmp(ckpt):
        raise UsageError(
            f"--run-dir {args.run_dir} already holds a run; continue it with --resume "
            f"{args.run_dir}, or pick another folder"
        )
    if os.path.exists(os.path.join(args.run_dir, CONFIG)):
        partial = (
            " (only an incomplete checkpoint.msgpack.tmp)" if os.path.exists(f"{ckpt}.tmp") else ""
        )
        raise UsageError(
            f"--run-dir {args.run_dir} holds a run that saved no checkpoint{partial}; "
            "remove it or pick another folder"
        )


def probe(args):
    """UsageError, naming the holder, if another run holds the folder this run would write (a
    check at start-up: `claim` takes the lock when the run opens its folder), or if its run files
    are not the run's own (`check_files`)."""
    folder = own_folder(args)
    if not folder:
        return
    check_files(folder)
    holder = held(folder)
    if holder:
        raise UsageError(
            f"{folder} is in use by another run ({holder}); wait for it to end, or pick another "
            f"folder"
        )


def check_files(folder: str):
    """UsageError, one line naming the file, if a file that a run reads or writes in `folder` (its
    run files, their .tmp, TensorBoard's event files, its videos/) is a symbolic link, or is not a
    regular file, or (one it appends to or cuts) has another name: a run folder may come from
    anyone, and a run reads and writes only its own files there, never through a link to a file
    elsewhere. (The folder itself may be a link: the user named it.)"""
    try:
        names = sorted(os.listdir(folder))
    except OSError:  # none yet, or not a folder (check says so)
        return
    for name in names:
        base = name[: -len(".tmp")] if name.endswith(".tmp") else name
        if (
            base not in RUN_FILES
            and name not in RUN_FOLDERS
            and not name.startswith("events.out.tfevents.")
        ):
            continue
        path = os.path.join(folder, name)
        info = os.lstat(path)
        # the lock, a .tmp, a folder, what is no file: nothing of the run's is lost
        fix = "remove it"
        if name in (CONFIG, CHECKPOINT):
            fix = "replace it with a copy of the file itself, or remove it"
        elif name in (METRICS, JOURNAL) and (
            stat.S_ISLNK(info.st_mode) or stat.S_ISREG(info.st_mode)
        ):
            # removing it would lose the run's curves, or its --deterministic replay
            fix = replace_with_copy(path)
        if stat.S_ISLNK(info.st_mode):
            raise UsageError(
                f"{path} is a symbolic link, and a run never reads or writes through a link in "
                f"its folder "
                f"(a run folder may come from anyone): {fix}"
            )
        if name in RUN_FOLDERS:
            continue
        if not stat.S_ISREG(info.st_mode) or (name in IN_PLACE and info.st_nlink > 1):
            what = (
                "has another name (a hard link)"
                if stat.S_ISREG(info.st_mode)
                else "is not a regular file"
            )
            raise UsageError(
                f"{path} {what}, and a run writes only its own files in its folder: {fix}"
            )


def replace_with_copy(path: str) -> str:
    """The advice for a linked file a run must keep: the command that makes it a file of its own."""
    copy = shlex.quote(f"{path}.copy")
    return (
        f"replace it with a copy of itself (cp {shlex.quote(path)} {copy} && mv {copy} "
        f"{shlex.quote(path)})"
    )


def held(folder: str):
    """The holder of `folder`'s lock ("pid N on host", or "unknown") if another process holds it,
    else None."""
    path = os.path.join(folder, LOCK)
    if not os.path.lexists(path):
        return None
    with checkpoints.open_own(
        path, os.O_RDWR, "r+"
    ) as f:  # an exclusive lock needs a file open for writing (NFS)
        if lock(f, path):
            fcntl.flock(f, fcntl.LOCK_UN)
            return None
        return f.read().strip() or "unknown"


def lock(f, path: str) -> bool:
    """Try an exclusive lock on open file `f`, a few times (another run's `probe` holds it for a
    moment): False if another run holds it. A file system without locks runs unlocked, said once."""
    for attempt in range(5):
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.05 * (attempt + 1))
        except OSError as e:  # ENOLCK, EOPNOTSUPP, ENOSYS: no locks here
            print(
                f"warning: {path}: the file system does not lock ({e.strerror}); nothing stops a "
                f"second run "
                "from using this folder at the same time",
                file=sys.stderr,
            )
            return True
    return False


def claim(folder: str, owner: str = "run"):
    """An exclusive lock on `folder`, held until the returned file is closed (or the process
    ends, however it ends: a dead run's lock never blocks). UsageError, naming the holder's pid
    and host, if another `owner` (a run, a sweep's launcher) holds it."""
    path = os.path.join(folder, LOCK)
    f = checkpoints.open_own(path, os.O_RDWR | os.O_CREAT, "r+")
    if not lock(f, path):
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise UsageError(
            f"{folder} is in use by another {owner} ({holder}); wait for it to end, or pick "
            f"another folder"
        )
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f


def make(args, resumed: bool):
    """Create and claim the run folder: --run-dir, else a resumed run's own, else a new
    runs/{env_id}__{exp_name}__{seed}__{time} (with _2, _3, ... if runs start in the same second).
    Returns (folder, whether this call created it, its lock). A folder that another run took
    between the start-up checks and now is refused (check, once the lock is held)."""
    run_dir = own_folder(args)
    if run_dir is not None:
        existed = os.path.isdir(run_dir)
        os.makedirs(run_dir, exist_ok=True)
        lock = claim(run_dir)
        try:
            check(args, resumed)
        except UsageError:
            lock.close()
            raise
        return run_dir, not existed, lock
    base = os.path.join(
        "runs", path_safe(f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}")
    )
    for n in itertools.count(1):
        run_dir = base if n == 1 else f"{base}_{n}"
        try:
            os.makedirs(run_dir)
        except FileExistsError:
            continue
        return run_dir, True, claim(run_dir)


def remove_new(folder: str, kept):
    """Remove what a new run wrote: `folder` itself if the run made it (`kept` None), else every
    entry but `kept`, the names it held before (a launcher's log.txt stays)."""
    if kept is None:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for name in set(os.listdir(folder)) - set(kept):
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)


def path_safe(name: str) -> str:
    """`name` with each run of characters awkward in a path (`:` of a user's env id, `/`, spaces,
    quotes) replaced by `-`."""
    return re.sub(r"[^A-Za-z0-9._=+,-]+", "-", name)


def kept(ckpt_file: str, lock) -> str:
    """Where the run's last good checkpoint is, in words, once a write has failed: the file, or
    where it went if the run folder was moved mid-run (the run's lock file `lock` stays open, and
    the kernel names its place now), or that there is none."""
    if os.path.exists(ckpt_file):
        return f"the last good checkpoint is kept: {ckpt_file}"
    try:
        now = os.path.dirname(os.readlink(f"/proc/self/fd/{lock.fileno()}"))
    except (AttributeError, OSError, ValueError):  # no lock (another process), no /proc
        now = None
    if now is not None and not os.path.isdir(now):  # "... (deleted)"
        return "the run folder was removed mid-run, and its checkpoints with it"
    if now is not None and os.path.exists(os.path.join(now, CHECKPOINT)):
        return (
            f"the last good checkpoint is kept: {os.path.join(now, CHECKPOINT)} (the run "
            f"folder was moved there mid-run)"
        )
    if os.path.isdir(os.path.dirname(ckpt_file)) or now is not None:
        return "no checkpoint written"
    return (
        f"the run folder {os.path.dirname(ckpt_file)} was moved or removed mid-run: where its "
        f"checkpoint is, is unknown"
    )


def read_config(path: str) -> dict:
    """A run's config.json; UsageError naming the file if it is missing, unreadable or not an
    object, and the key if its "resumes" is not a list of objects."""
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise UsageError(
            f"{path} is missing: the run's record is gone; restore it, or --resume into a new "
            f"--run-dir"
        )
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nested too deep
        raise UsageError(
            f"{path} is not readable JSON ({type(e).__name__}); restore it, or --resume into a "
            f"new --run-dir"
        )
    if not isinstance(config, dict):
        raise UsageError(f"{path} holds a {type(config).__name__}, not a run's record (an object)")
    resumes, again = config.get("resumes", []), "restore it, or --resume into a new --run-dir"
    if not isinstance(resumes, list):  # a resume appends its entry to the list
        raise UsageError(
            f'{path}: "resumes" is {json.dumps(resumes):.80}, not a list of resumes\' records; '
            f"{again}"
        )
    for i, resume in enumerate(resumes):
        if not isinstance(resume, dict):
            raise UsageError(
                f'{path}: "resumes"[{i}] is {json.dumps(resume):.80}, not a resume\'s record (an '
                f"object); {again}"
            )
    return config


def write_config(run_dir: str, args, changed: dict, global_step: int, batch: str):
    """config.json: the run's flags as first resolved, with the update's global `batch` in words,
    never overwritten; each resume into the run's own folder appends the flags it changed (from
    what the folder's run trained with, `differences`), and the step it resumed from, under
    "resumes" (read_config's errors if the record is damaged)."""
    path = os.path.join(run_dir, CONFIG)
    config = dict(dataclasses.asdict(args), global_batch=batch)
    continued = args.resume and (
        os.path.exists(path)
        or same_folder(run_dir, own_folder(dataclasses.replace(args, run_dir=None)))
    )
    if continued:
        config = read_config(path)
        # what this folder's run trained with before, not the checkpoint's (another run's, copied
        # in by utils/launch.py --pbt)
        changed = differences(config, args, changed)
    if args.resume:
        resume = {
            "step": global_step,
            "wall_time": time.time(),
            "from": os.path.abspath(args.resume),
            "changed": changed,
            "global_batch": batch,
        }
        config["resumes"] = [*config.get("resumes", []), resume]
    checkpoints.write_atomically(path, json.dumps(config, indent=2).encode())


def differences(config: dict, args, changed: dict) -> dict:
    """The flags that differ from what the run of `config` (config.json's, with its resumes'
    changes) last trained with: those of `changed` (named on the command line, and unlike the
    checkpoint's) and those a checkpoint brought from another run (utils/launch.py --pbt copies
    one into a member's folder). The place and the launch's own are left out."""
    effective = dict(config)
    for resume in config.get("resumes", []):
        effective.update(resume.get("changed", {}))
    now = dict(dataclasses.asdict(args), **changed)
    said = json.loads(json.dumps(now, default=str))  # as config.json holds them (a tuple: a list)
    return {
        name: now[name]
        for name, value in said.items()
        if name in effective
        and name not in (*checkpoints.PLACE, *checkpoints.LAUNCH)
        and effective[name] != value
    }


def logged_steps(run_dir: str, tag: str) -> set:
    """The steps at which metrics.jsonl in `run_dir` holds a record of `tag` (none: no file)."""
    path = os.path.join(run_dir, METRICS)
    if not os.path.isfile(path):
        return set()
    steps = set()
    with open(path, "rb") as f:
        for line in f:
            try:
                record = json.loads(line)
                if record["tag"] == tag:
                    steps.add(int(record["step"]))
            except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
                pass  # a line cut off by a crash (cut_metrics's rule)
    return steps


def cut_metrics(run_dir: str, global_step: int) -> int:
    """On resume: drop the records of metrics.jsonl past `global_step` (episodes sampled, and
    never learned from, before the run stopped; a line cut off by a crash, or any other line that is
    no record with a finite step), so that the resumed run does not cover those steps twice.
    Returns how many were dropped."""
    path = os.path.join(run_dir, METRICS)
    if not os.path.isfile(path):
        return 0
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    kept = []
    for line in lines:
        try:
            if int(json.loads(line)["step"]) <= global_step:
                kept.append(line)
        except (
            ValueError,
            KeyError,
            TypeError,
            OverflowError,
            RecursionError,
        ):  # a step of Infinity, deep nesting
            pass
    dropped = sum(1 for line in lines if line.strip()) - len(kept)
    if dropped:
        checkpoints.write_atomically(path, b"".join(line + b"\n" for line in kept))
    return dropped
