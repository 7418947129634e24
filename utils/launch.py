"""Run a sweep: the cross product of a grid of flags and seeds, as local processes a few at a
time (rlpyt's local queue), or as a SLURM array script.

    python utils/launch.py appo_envpool.py --grid learning-rate=1e-4,3e-4 num-envs=8,16 \
        --seeds 1 2 3 --parallel 2 --name lr -- --env-id CartPole-v1

With --pbt the grid's runs x seeds are one population (Sample Factory's population-based
training, docs/launch.md): trained in rounds of --pbt-interval env steps, ranked at each round's
end, the bottom copying a top member's checkpoint and the flags of --pbt-mutate mutated; each
round is recorded in DIR/NAME/pbt.jsonl.

    python utils/launch.py appo_envpool.py --name pbt --pbt --pbt-interval 20000 \
        --grid learning-rate=1e-5,3e-5,3e-2,1e-1 --parallel 2 -- --env-id CartPole-v1

Each run trains in DIR/NAME/<varied flags>__seed<S>/ with `--exp-name NAME__<varied flags>`, so
`utils/plot.py DIR/NAME` draws one curve per configuration (mean and spread over seeds) and
tabulates each configuration's final return. DIR/NAME/sweep.json records the grid and each
run's state (queued, running, done, failed, stopped) and exit code; each run's output goes to
its folder's log.txt. The same command again skips finished runs, resumes those that saved a
checkpoint (`--resume`) and starts the others afresh. Ctrl-C or SIGTERM stops every run cleanly
(each writes its checkpoint).

One launcher runs a sweep at a time (a lock in DIR/NAME, as run folders have). Its runs die with
it however it dies: the kernel sends each SIGTERM when the launcher ends (Linux's
PR_SET_PDEATHSIG), so that a kill -9 of the launcher stops them cleanly, with a checkpoint; a
relaunch waits for any run still stopping before it resumes it.
"""

import ctypes
import itertools
import json
import math
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import tyro

from jax_async_rl import checkpoints, flags, folders
from jax_async_rl.checkpoints import (
    CHECKPOINT,
    CONFIG,
    FIXED_ON_RESUME,
    METRICS,
    complete_tmp,
    load_script,
)
from jax_async_rl.flags import UsageError, run_tool
from jax_async_rl.logs import clock_time

SWEEP = "sweep.json"
LOG = "log.txt"
PBT = "pbt.jsonl"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass
class LaunchArgs:
    """Run a grid of flags x seeds of one training script (flags after `--` go to every run)."""

    script: Annotated[tyro.conf.Positional[str], tyro.conf.arg(metavar="SCRIPT")]
    """the training script (a repository script or a user's copy)"""
    name: str
    """the sweep's name: its runs go under DIR/NAME/"""
    grid: list[str] = field(default_factory=list)
    """flags to vary, each FLAG=V1,V2,... (flag names without the leading --)"""
    seeds: list[int] = field(default_factory=lambda: [1])
    """seeds of every configuration"""
    parallel: int = 1
    """runs at a time; the rest wait in the queue"""
    out: str = "runs"
    """DIR, the folder that holds the sweep's folder"""
    slurm: bool = False
    """write DIR/NAME/sweep.sbatch, a SLURM array script with one task a run, instead of running
    (each grid value first checked against the script's flags, as its runs would check it); with
    --pbt, a job that runs this launcher (the population's rounds) in its allocation"""
    pbt: bool = False
    """population-based training: the grid's runs x seeds (2 or more) are one population, stepped
    in rounds of --pbt-interval env steps; at each round's end the members are ranked (the latest
    eval/episodic_return with --eval-interval, else the mean of the last 100 training episodes),
    the bottom --pbt-replace-fraction copies a top member's checkpoint (weights, optimiser,
    normaliser, schedule position) and flags, and every member outside the top but the first
    mutates --pbt-mutate (Sample Factory's rules; each round in DIR/NAME/pbt.jsonl)"""
    pbt_interval: int = 0
    """with --pbt: env steps of a round (each member pauses at every multiple: --pause-at)"""
    pbt_mutate: list[str] = field(default_factory=lambda: ["learning-rate"])
    """with --pbt: the float flags explored, each FLAG or FLAG=LOW:HIGH (the range its mutations
    stay in; default: the flag's own)"""
    pbt_replace_fraction: float = 0.3
    """with --pbt: the fraction of the population (rounded up) that is the top, and the bottom"""
    pbt_mutation_rate: float = 0.15
    """with --pbt: the probability that a flag mutates, each flag each round"""
    pbt_replace_gap: float = 0.1
    """with --pbt: a bottom member copies a top one only when the top's objective is higher by
    more than this fraction of it, and by more than --pbt-replace-gap-absolute"""
    pbt_replace_gap_absolute: float = 1e-6
    """with --pbt: see --pbt-replace-gap"""
    pbt_seed: int = 0
    """with --pbt: seed of the launcher's draws (who copies whom, the mutations)"""


def check_names(args: LaunchArgs):
    """UsageError for text that would not stay one line where the launcher writes it: --name is a
    folder and SLURM's job name (a plain name), --out is in an #SBATCH line (sbatch reads a
    backslash as an escape), and a grid value is in a folder's name (no control character)."""
    if not re.fullmatch(r"[A-Za-z0-9._+=,-]+", args.name) or args.name in (".", ".."):
        raise UsageError(
            f"--name {args.name!r}: a sweep's name is a folder name: letters, digits and . _ - + "
            f"= , only"
        )
    for what, text in [("--out", args.out), *(("--grid", entry) for entry in args.grid)]:
        if any(ord(c) < 32 or ord(c) == 127 for c in text) or what == "--out" and "\\" in text:
            raise UsageError(
                f"{what} {text!r} holds a control "
                f"character{' or a backslash' * (what == '--out')}; "
                "pass plain text"
            )


# A grid's flag and value name each run's folder and are words of the SLURM script: no path
# separator, space, quote, $, backtick, ; or other text a shell or a folder name reads otherwise.
GRID_WORD = re.compile(r"[A-Za-z0-9._+:@%=-]+")


def parse_grid(grid: list) -> list:
    """["lr=1,2", ...] -> [("lr", ["1", "2"]), ...]; UsageError for a malformed entry, a flag or
    value of other characters than GRID_WORD's, or a value or a flag named twice (two runs of one
    folder)."""
    axes = []
    for entry in grid:
        flag, _, values = entry.partition("=")
        flag, values = flag.removeprefix("--"), values.split(",")
        if not flag or not all(values):
            raise UsageError(
                f"--grid {entry}: expected FLAG=V1,V2,... (e.g. learning-rate=1e-4,3e-4)"
            )
        for word in [flag, *values]:
            if not GRID_WORD.fullmatch(word) or word in (".", ".."):
                raise UsageError(
                    f"--grid {entry}: {word!r} names the runs' folders and goes into the SLURM "
                    f"script: "
                    "letters, digits and . _ - + : @ % = only (pass other values after --)"
                )
        twice = [v for i, v in enumerate(values) if v in values[:i]]
        if twice:
            raise UsageError(
                f"--grid {entry}: {twice[0]} is named twice (its runs would write one folder)"
            )
        axes.append((flag, values))
    if len({flag for flag, _ in axes}) < len(axes):
        raise UsageError("--grid names a flag twice")
    return axes


def check_values(script: str, axes: list):
    """UsageError, one line naming the flag and value, for a grid value the script's runs would
    refuse at start-up (a flag it lacks, a value of another type, one outside the flag's range),
    checked with the script's own Args as its command line checks them: an sbatch file runs later,
    on a cluster, where each run's exit 2 would come after the queue's wait."""
    args_class = load_script(script).Args
    for flag, values in axes:
        for value in values:
            tokens = flag_tokens(flag, value)
            try:
                flags.check_names(tokens, args_class)
                flags.check_bounds(flags.parse(args_class, tokens))
            except UsageError as e:
                raise UsageError(
                    f"--grid {flag}={value}: {os.path.basename(script)} would refuse it ({e})"
                ) from None


def flag_tokens(flag: str, value: str) -> list:
    """A grid value as the script's command line takes it: a boolean is a switch (tyro's
    `--flag` / `--no-flag`, which take no value), anything else `--flag value`."""
    if value.lower() in ("true", "false"):
        return [f"--{flag}" if value.lower() == "true" else f"--no-{flag}"]
    return [f"--{flag}", value]


def plan(args: LaunchArgs, common: list) -> list:
    """The sweep's runs: {"name", "config", "flags", "seed", "dir"}, configurations x seeds."""
    axes = parse_grid(args.grid)
    for flag in ("seed", "run-dir", "exp-name", "resume", "pause-at"):
        if any(token.split("=")[0] == f"--{flag}" for token in common) or flag in {
            f for f, _ in axes
        }:
            raise UsageError(f"--{flag} is the launcher's to set for each run; leave it out")
    sweep_dir = Path(args.out) / args.name
    runs = []
    for values in itertools.product(*[v for _, v in axes]) if axes else [()]:
        config = "__".join(f"{flag}={value}" for (flag, _), value in zip(axes, values)) or "default"
        flags = [
            token for (flag, _), value in zip(axes, values) for token in flag_tokens(flag, value)
        ]
        for seed in args.seeds:
            name = f"{config}__seed{seed}"
            runs.append(
                {
                    "name": name,
                    "config": config,
                    "flags": flags,
                    "seed": seed,
                    "dir": str(sweep_dir / name),
                }
            )
    return runs


def new_run(script: str, run: dict, common: list, exp_name: str) -> list:
    """A run's command line as a new run: the common flags, its own, its seed and folder."""
    return [
        script,
        *common,
        *run["flags"],
        "--seed",
        str(run["seed"]),
        "--run-dir",
        run["dir"],
        "--exp-name",
        f"{exp_name}__{run['config']}",
    ]


def env_flags(common: list) -> list:
    """The sweep's --env-id and --env-module as its command line named them: a resume names them
    again, so that a user's env module, which a run folder alone never imports, is imported."""
    out = []
    for i, token in enumerate(common):
        name = token.split("=")[0]
        if name in ("--env-id", "--env-module"):
            out += [token] if "=" in token else common[i : i + 2]
    return out


def command(script: str, run: dict, common: list, exp_name: str, log) -> list:
    """A run's command: `--resume` of one that saved a checkpoint, else a new run. An earlier
    attempt that saved none (a run killed before its first checkpoint) is cleared first, its
    log kept: nothing in it can be resumed, and a new run refuses a folder holding it."""
    ckpt = os.path.join(run["dir"], CHECKPOINT)
    pause = run.get("pause", [])  # --pbt: the round's end
    if os.path.exists(ckpt) or complete_tmp(ckpt):
        resume = [script, "--resume", run["dir"], *env_flags(common), *run.get("resume_flags", [])]
        return [sys.executable, *resume, *pause]
    if os.path.exists(os.path.join(run["dir"], CONFIG)) and not folders.held(run["dir"]):
        folders.remove_new(run["dir"], {LOG})
        print(
            f"launch.py: the attempt before saved no checkpoint; starting {run['name']} afresh",
            file=log,
            flush=True,
        )
    return [sys.executable, *new_run(script, run, common, exp_name), *pause]


def save(sweep_dir: Path, record: dict):
    """sweep.json, written whole: a temporary file of this launcher's own name, fsync, rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{SWEEP}.", suffix=".tmp", dir=sweep_dir)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, sweep_dir / SWEEP)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def slurm_script(args: LaunchArgs, runs: list, common: list) -> str:
    """An sbatch array script: task i runs (or resumes) run i, in the same folders. Every value is
    quoted (sbatch reads quotes in #SBATCH lines as the shell does); check_names refused those
    that no quoting keeps on one line."""
    output = shlex.quote(f"{Path(args.out) / args.name}/slurm_%a.out")
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={shlex.quote(args.name)}",
        f"#SBATCH --array=0-{len(runs) - 1}",
        f"#SBATCH --output={output}",
        "",
        "case $SLURM_ARRAY_TASK_ID in",
    ]
    for i, run in enumerate(runs):
        new = " ".join(shlex.quote(token) for token in new_run(args.script, run, common, args.name))
        resume = " ".join(
            shlex.quote(token)
            for token in [args.script, "--resume", run["dir"], *env_flags(common)]
        )
        lines.append(
            f"  {i}) if [ -f {shlex.quote(run['dir'])}/{CHECKPOINT} ]; then python {resume}; "
            f"else python {new}; fi ;;"
        )
    return "\n".join([*lines, "esac", ""])


def main(args: LaunchArgs, common: list) -> int:
    if not os.path.isfile(args.script):
        raise UsageError(f"{args.script}: no such training script")
    if args.parallel < 1 or not args.seeds:
        raise UsageError("--parallel must be positive and --seeds must name at least one seed")
    check_names(args)
    runs, sweep_dir = plan(args, common), Path(args.out) / args.name
    if args.slurm:  # run here, each run checks its own flags before anything starts
        check_values(args.script, parse_grid(args.grid))
    if args.pbt:
        check_population(args, runs, common)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    lock = folders.claim(str(sweep_dir), "launcher")  # held for this launcher's life
    try:
        return launch(args, common, runs, sweep_dir)
    finally:
        lock.close()


def launch(args: LaunchArgs, common: list, runs: list, sweep_dir: Path) -> int:
    """The SLURM script, or the sweep run here: its record read, the runs a dead launcher left
    waited for, then the queue."""
    if args.slurm and args.pbt:
        (sweep_dir / "pbt.sbatch").write_text(pbt_slurm_script(args, common))
        print(f"a population of {len(runs)}: submit with `sbatch {sweep_dir / 'pbt.sbatch'}`")
        return 0
    if args.slurm:
        (sweep_dir / "sweep.sbatch").write_text(slurm_script(args, runs, common))
        print(f"{len(runs)} runs: submit with `sbatch {sweep_dir / 'sweep.sbatch'}`")
        return 0
    previous, before = {}, {}
    if (sweep_dir / SWEEP).exists():
        before = json.loads((sweep_dir / SWEEP).read_text())
        if (
            before.get("common") != common
            or Path(before.get("script", "")).name != Path(args.script).name
        ):
            raise UsageError(
                f"{sweep_dir} ran {before.get('script')} with "
                f"{shlex.join(before.get('common', []))}: "
                "a sweep's runs share the script and flags after --; give new ones a new --name"
            )
        if bool(before.get("pbt")) != args.pbt:
            raise UsageError(
                f"{sweep_dir} is {'a population (--pbt)' if before.get('pbt') else 'a sweep'}: "
                "run it as it was started, or give the new one a new --name"
            )
        previous = {r["name"]: r for r in before.get("runs", [])}
    if args.pbt:
        return run_population(args, runs, previous, before if previous else {}, sweep_dir, common)
    for run in runs:
        run.update(
            state="done" if previous.get(run["name"], {}).get("state") == "done" else "queued",
            exit_code=None,
        )
        run["log"] = str(Path(run["dir"]) / LOG)
    for run in previous.values():
        if orphan(
            run
        ):  # a run of a launcher that died: it got SIGTERM with its death and is stopping
            print(
                f"waiting for {run['name']} (pid {run['pid']}), left by a launcher that died, to "
                f"stop",
                flush=True,
            )
            while orphan(run):
                time.sleep(0.2)
    record = {
        "script": args.script,
        "grid": args.grid,
        "seeds": args.seeds,
        "common": common,
        "runs": runs,
    }
    return run_queue(args, record, sweep_dir, common)


def orphan(run: dict) -> bool:
    """Whether the process recorded as running `run` is still alive and runs it (its command line
    names the run's folder: a pid the system gave to another process since is not it)."""
    try:
        with open(f"/proc/{int(run['pid'])}/cmdline", "rb") as f:
            return run.get("state") == "running" and os.fsencode(run["dir"]) in f.read()
    except (KeyError, TypeError, ValueError, OSError):
        return False


def tie_to(launcher: int):
    """In a run's process, before it executes the script: the kernel sends it SIGTERM when the
    launcher dies, however it dies, so that it stops cleanly (Linux; elsewhere a relaunch waits
    for it: `orphan`)."""
    prctl = getattr(ctypes.CDLL(None), "prctl", None) if sys.platform.startswith("linux") else None

    def in_child():
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != launcher:  # the launcher died before the tie was made
            os._exit(128 + signal.SIGTERM)

    return in_child


def run_queue(args: LaunchArgs, record: dict, sweep_dir: Path, common: list) -> int:
    """Start runs `--parallel` at a time until none is queued; a progress line every 5 s."""
    runs, procs, stop, started = record["runs"], {}, [], time.time()
    handlers = {
        s: signal.signal(s, lambda signum, frame: stop.append(signum))
        for s in (signal.SIGINT, signal.SIGTERM)
    }
    durations, last_line, signalled, tie = [], 0.0, set(), tie_to(os.getpid())
    try:
        while True:
            if stop:
                for i, proc in procs.items():
                    # once: a second signal would end a run during its clean-up
                    if i not in signalled:
                        signalled.add(i)
                        proc.send_signal(signal.SIGTERM)  # each run writes its checkpoint
            for i, proc in list(procs.items()):
                if proc.poll() is not None:
                    run = runs[i]
                    run["exit_code"] = proc.returncode
                    # Stopped: 128 + signal, or killed by a signal (< 0) after this launcher sent it
                    # SIGTERM.
                    stopped = proc.returncode > 128 or (proc.returncode < 0 and i in signalled)
                    run["state"] = (
                        "done" if proc.returncode == 0 else "stopped" if stopped else "failed"
                    )
                    durations.append(time.time() - run.pop("start"))
                    run.pop("pid")
                    del procs[i]
            queued = [i for i, run in enumerate(runs) if run["state"] == "queued"]
            while not stop and queued and len(procs) < args.parallel:
                i = queued.pop(0)
                os.makedirs(runs[i]["dir"], exist_ok=True)
                with open(runs[i]["log"], "a") as log:
                    procs[i] = subprocess.Popen(
                        command(args.script, runs[i], common, args.name, log),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        preexec_fn=tie,
                    )
                runs[i].update(state="running", start=time.time(), pid=procs[i].pid)
            save(
                sweep_dir,
                {**record, "runs": [{k: v for k, v in r.items() if k != "start"} for r in runs]},
            )
            if not procs and (stop or not queued):
                break
            if time.time() - last_line > 5:
                last_line = time.time()
                print(
                    progress_line(runs, durations, args.parallel, time.time() - started), flush=True
                )
            time.sleep(0.2)
    finally:
        stop_all(procs.values())
        for s, handler in handlers.items():
            signal.signal(s, handler)
    return summary(runs, stop)


def stop_all(procs):
    """After an error in the launcher: SIGTERM to the runs still going (each writes its
    checkpoint), SIGKILL to those not gone within a minute."""
    procs = list(procs)
    for proc in procs:
        proc.terminate()
    deadline = time.time() + 60
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()


def progress_line(runs: list, durations: list, parallel: int, elapsed: float) -> str:
    count = {
        s: sum(r["state"] == s for r in runs)
        for s in ("done", "running", "queued", "failed", "stopped")
    }
    stopped = f", {count['stopped']} stopped" if count["stopped"] else ""
    return (
        f"sweep: {count['done']} done, {count['running']} running, {count['queued']} queued, "
        f"{count['failed']} failed{stopped}  ({elapsed:.0f} s)  ETA "
        f"{sweep_eta(runs, durations, parallel, time.time())}"
    )


def sweep_eta(runs: list, durations: list, parallel: int, now: float) -> str:
    """The time left: each running run's own ETA (its last progress line), a queued run the mean
    time a run took (or, before any ended, the running runs' elapsed + ETA), the runs placed
    `parallel` at a time as the queue places them."""
    running = [
        (now - run["start"], run_eta(run["log"])) for run in runs if run["state"] == "running"
    ]
    guesses = durations or [elapsed + left for elapsed, left in running if left is not None]
    if not guesses:
        return "n/a (no run has an ETA yet)"
    typical = sum(guesses) / len(guesses)
    slots = sorted(
        [left if left is not None else max(typical - elapsed, 0.0) for elapsed, left in running]
        + [0.0] * max(parallel - len(running), 0)
    )
    for _ in range(sum(run["state"] == "queued" for run in runs)):
        slots[0] += typical
        slots.sort()
    return clock_time(max(slots, default=0.0))


def run_eta(log: str):
    """The seconds a run's last progress line (in its log) gives as its ETA, or None (n/a)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(os.fstat(f.fileno()).st_size - 4096, 0))
            lines = [
                line for line in f.read().decode(errors="replace").splitlines() if " ETA " in line
            ]
    except OSError:
        return None
    match = re.search(r" ETA (\d+):(\d\d):(\d\d)$", lines[-1].rstrip()) if lines else None
    return int(match[1]) * 3600 + int(match[2]) * 60 + int(match[3]) if match else None


# --- population-based training (--pbt) ---


def check_population(args: LaunchArgs, runs: list, common: list):
    """UsageError, one line, for a population the launcher cannot train: fewer than 2 members, no
    --pbt-interval, a flag --pbt-mutate cannot mutate or a range outside the flag's own,
    --deterministic (a copied checkpoint does not fit another run's action journal)."""
    if len(runs) < 2:
        raise UsageError(
            f"--pbt: a population of {len(runs)}; name 2 or more members (--grid values x --seeds)"
        )
    if args.pbt_interval <= 0:
        raise UsageError("--pbt needs --pbt-interval, the env steps of a round (a positive number)")
    if not 0 < args.pbt_replace_fraction <= 0.5 or not 0 <= args.pbt_mutation_rate <= 1:
        raise UsageError(
            "--pbt-replace-fraction must be in (0, 0.5] and --pbt-mutation-rate in [0, 1]"
        )
    if any(token.split("=")[0] == "--deterministic" for token in common):
        raise UsageError(
            "--pbt copies one member's checkpoint into another, whose --deterministic action "
            "journal it does not fit: leave --deterministic out"
        )
    mutations(args.script, args.pbt_mutate)


def mutations(script: str, entries: list) -> dict:
    """{field: (low, high)} of --pbt-mutate's FLAG or FLAG=LOW:HIGH entries (None: the flag's own
    bound); UsageError for a flag the script lacks, one that is not a float a resume may change,
    or a range that is not one or leaves the flag's own."""
    args_class = load_script(script).Args
    hints = typing.get_type_hints(args_class, include_extras=True)
    out = {}
    for entry in entries:
        flag, equals, bounds = entry.partition("=")
        name = flag.removeprefix("--").replace("-", "_")
        if not name or (equals and not bounds):
            raise UsageError(
                f"--pbt-mutate {entry!r}: expected FLAG or FLAG=LOW:HIGH (e.g. "
                "learning-rate=1e-5:1e-2)"
            )
        flags.check_names([f"--{flag.removeprefix('--')}"], args_class)
        kind = (
            typing.get_args(hints[name])[0] if hasattr(hints[name], "__metadata__") else hints[name]
        )
        if float not in (kind, *typing.get_args(kind)) or name in FIXED_ON_RESUME:
            raise UsageError(
                f"--pbt-mutate {flag}: cannot mutate; only a number flag (float) that a resume "
                "may change can"
            )
        low = high = None
        if bounds:
            try:
                low, high = (float(x) for x in bounds.split(":"))
            except ValueError:
                raise UsageError(
                    f"--pbt-mutate {entry}: expected FLAG or FLAG=LOW:HIGH (e.g. "
                    "learning-rate=1e-5:1e-2)"
                ) from None
            wrong = [v for v in (low, high) if flags.out_of_range(hints[name], v)]
            if not low < high or wrong:
                why = f"{wrong[0]} is outside its range" if wrong else "LOW must be below HIGH"
                raise UsageError(f"--pbt-mutate {entry}: {why}")
        out[name] = (low, high, hints[name])
    return out


def perturb(value: float, name: str, default: float, rng, rate: float, bounds) -> float:
    """Sample Factory's exploration of one flag: with probability `rate`, back to `default` (1
    in 100, where it is not there yet) or multiplied or divided by a factor from U[1.1, 1.5] (γ and
    λ: their 1 - x, by U[1.01, 1.2]); kept within `bounds` (low, high, the flag's annotation): a
    value outside is not taken."""
    if rng.random() > rate:
        return value
    if value != default and rng.random() < 0.01:
        return default
    if name in ("gamma", "gae_lambda"):
        amount = rng.uniform(1.01, 1.2)
        new = 1.0 - ((1.0 - value) / amount if rng.random() < 0.5 else (1.0 - value) * amount)
    else:
        amount = rng.uniform(1.1, 1.5)
        new = value / amount if rng.random() < 0.5 else value * amount
    low, high, hint = bounds
    new = min(max(new, low if low is not None else new), high if high is not None else new)
    return value if flags.out_of_range(hint, new) else new


def decide(order: list, objectives: dict, values: dict, defaults: dict, bounds: dict, args, rng):
    """One round's exploit and explore (Sample Factory's _update_policy), for the members in
    `order` (the first never mutates): the top ceil(fraction x N) by objective stay; each of the
    bottom as many copies a random top member when that one's objective is higher by both gaps (a
    member with no objective, crashed, always does); every member outside the top then takes its
    source's flags, mutated. Returns {member: {"rank", "copies" (or None), "new": flags}}."""
    ranked = sorted(
        order, key=lambda m: (objectives[m] is not None, objectives[m] or 0.0), reverse=True
    )
    count = math.ceil(args.pbt_replace_fraction * len(order))
    top, bottom = ranked[:count], ranked[-count:]
    out = {}
    for member in order:
        source = member
        if member in bottom and member not in top:
            candidate = rng.choice(top)
            mine, theirs = objectives[member], objectives[candidate]
            if mine is None or (
                abs(theirs - mine) > args.pbt_replace_gap_absolute
                and abs((theirs - mine) / (theirs + 1e-8)) > args.pbt_replace_gap
            ):
                source = candidate
        new = dict(values[source])
        if member not in top and member != order[0]:
            new = {
                name: perturb(v, name, defaults[name], rng, args.pbt_mutation_rate, bounds[name])
                for name, v in new.items()
            }
        out[member] = {
            "rank": ranked.index(member) + 1,
            "copies": None if source == member else source,
            "new": new,
        }
    return out


RESOLVE = """
import dataclasses, json, sys
from jax_async_rl import flags
from jax_async_rl.checkpoints import load_script
module = load_script(sys.argv[1])
args = module.resolve_args(flags.parse(module.Args, json.loads(sys.argv[2])))
print(json.dumps({name: getattr(args, name) for name in json.loads(sys.argv[3])}))
"""


def resolved(script: str, common: list, names: list) -> dict:
    """{flag: value} of `names` as the script resolves the common flags (its preset filled in):
    what a mutation may reset a flag to. Asked of a child process, so that this one never starts
    JAX, whose threads a fork of the runs' processes (with their PR_SET_PDEATHSIG) would copy."""
    done = subprocess.run(
        [sys.executable, "-c", RESOLVE, script, json.dumps(common), json.dumps(names)],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        said = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UsageError(f"--pbt: {os.path.basename(script)} refuses the flags after -- ({said})")
    return {name: float(value) for name, value in json.loads(done.stdout.splitlines()[-1]).items()}


def objective(run_dir: str, step: int):
    """(The member's objective at `step`, what it is): its latest eval/episodic_return up to
    `step` where it logs any, else the mean of its last 100 charts/episodic_return up to `step`;
    (None, ...) when it has neither (or no metrics)."""
    evaluations, returns = [], []
    try:
        with open(os.path.join(run_dir, METRICS)) as f:
            for line in f:
                try:
                    record = json.loads(line)
                    if int(record["step"]) > step:
                        continue
                    if record["tag"] == "eval/episodic_return":
                        evaluations.append((int(record["step"]), float(record["value"])))
                    elif record["tag"] == "charts/episodic_return":
                        returns.append(float(record["value"]))
                except (ValueError, KeyError, TypeError):
                    pass
    except OSError:
        return None, "none"
    if evaluations:
        return max(evaluations)[1], "eval/episodic_return"
    if returns:
        return sum(returns[-100:]) / len(returns[-100:]), "charts/episodic_return, last 100"
    return None, "none"


def member_step(run_dir: str):
    """(The env step of a member's checkpoint, its budget's last step) or None where it has no
    readable checkpoint or config.json."""
    try:
        payload = checkpoints.read_checkpoint(os.path.join(run_dir, CHECKPOINT))
        config = folders.read_config(os.path.join(run_dir, CONFIG))
        batch = int(re.search(r"= (\d+) env steps", config["global_batch"])[1])
        total = int(config["total_timesteps"])
    except (UsageError, KeyError, TypeError, ValueError, OSError):
        return None
    step = int(payload["state"]["global_step"])
    return step, step + (total - step) // batch * batch


def flag_values(run_dir: str, names) -> dict:
    """The values of `names` a member trains with: its config.json's, each resume's changes
    applied."""
    config = folders.read_config(os.path.join(run_dir, CONFIG))
    values = {name: config.get(name) for name in names}
    for resume in config.get("resumes", []):
        for name in names:
            if name in resume.get("changed", {}):
                values[name] = resume["changed"][name]
    return {name: float(v) for name, v in values.items()}


def run_population(args, runs, previous, before, sweep_dir, common) -> int:
    """The population's rounds: each member trains (or resumes) to the round's end (`--pause-at`),
    `--parallel` at a time; then `decide`, recorded in pbt.jsonl before any checkpoint is copied,
    so that a launcher stopped between the two applies the same round again. A Ctrl-C stops the
    members with their checkpoints; the same command continues the round."""
    bounds = mutations(args.script, args.pbt_mutate)
    defaults = resolved(args.script, common, list(bounds))
    record = {
        "script": args.script,
        "grid": args.grid,
        "seeds": args.seeds,
        "common": common,
        "pbt": before.get("pbt", {"round": 0, "values": {}}),
        "runs": runs,
    }
    for run in runs:
        old = previous.get(run["name"], {})
        run.update(state=old.get("state", "queued"), exit_code=old.get("exit_code"))
        run["log"] = str(Path(run["dir"]) / LOG)
        if run["state"] in ("running", "stopped", "failed"):
            run["state"] = "queued"
    by_name = {run["name"]: run for run in runs}
    while True:
        r = record["pbt"]["round"]
        boundary = (r + 1) * args.pbt_interval
        for run in runs:
            run["pause"] = ["--pause-at", str(boundary)]
            values = record["pbt"]["values"].get(run["name"], {})
            run["resume_flags"] = [
                *(
                    t
                    for name, v in values.items()
                    for t in (f"--{name.replace('_', '-')}", repr(v))
                ),
                *("--seed", str(run["seed"]), "--exp-name", f"{args.name}__{run['config']}"),
            ]
            at = member_step(run["dir"])  # stopped once it had paused (or finished): not again
            if run["state"] == "queued" and at is not None and at[0] >= min(boundary, at[1]):
                run["state"] = "done"
        code = run_queue(args, record, sweep_dir, common)
        if code > 128:
            return code
        steps = {run["name"]: member_step(run["dir"]) for run in runs}
        for run in runs:
            at = steps[run["name"]]
            if run["state"] == "done" and at is None:
                run["state"] = "failed"
            elif run["state"] == "done" and at[0] < at[1]:
                run["state"] = "paused"  # reached the round's end, not the budget's
        if all(run["state"] == "done" for run in runs):
            save(sweep_dir, record)
            print(f"population: {len(runs)} members trained to the end in {r + 1} rounds")
            return 0
        if not any(run["state"] == "paused" for run in runs):  # no round after this one
            failed = [run["name"] for run in runs if run["state"] == "failed"]
            finished = sum(run["state"] == "done" for run in runs)
            print(
                f"population: {', '.join(failed)} failed in the last round, where no member "
                f"pauses to replace it; {finished} finished; see the log.txt of each",
                file=sys.stderr,
            )
            save(sweep_dir, record)
            return 1
        logged = read_rounds(sweep_dir)
        if logged and logged[-1]["round"] == r:  # decided before a stop: applied again
            members = logged[-1]["members"]
        else:
            members = decide_round(args, sweep_dir, runs, steps, boundary, record, bounds, defaults)
        for member in members:
            if member["copies"] is not None:
                copy_member(by_name[member["copies"]]["dir"], by_name[member["name"]]["dir"])
        say = ", ".join(f"{m['name']} copies {m['copies']}" for m in members if m["copies"])
        print(f"population: round {r} ended at step {boundary}; {say or 'no copy'}", flush=True)
        record["pbt"] = {"round": r + 1, "values": {m["name"]: m["new"] for m in members}}
        for run in runs:
            if run["state"] != "done":
                run["state"] = "queued"
        save(sweep_dir, record)


def decide_round(args, sweep_dir, runs, steps, boundary, record, bounds, defaults) -> list:
    """This round's members as pbt.jsonl records them (`decide` on each member's objective at its
    own step: the first update's at or past the boundary), appended there before any copy."""
    found = {
        run["name"]: objective(run["dir"], (steps[run["name"]] or (boundary,))[0]) for run in runs
    }
    objectives = {
        run["name"]: None if run["state"] == "failed" else found[run["name"]][0] for run in runs
    }
    values = record["pbt"]["values"]
    if not values:  # the first round's end: what each member trained with (grid value or preset)
        alive = [run for run in runs if run["state"] != "failed"]
        values = {run["name"]: flag_values(run["dir"], bounds) for run in alive}
        for run in runs:  # a member that crashed in round 0: the first alive's
            values.setdefault(run["name"], values[alive[0]["name"]])
    names = [run["name"] for run in runs]
    r = record["pbt"]["round"]
    rng = random.Random(f"{args.pbt_seed}:{r}")
    decisions = decide(names, objectives, values, defaults, bounds, args, rng)
    members = [
        dict(name=run["name"], state=run["state"], objective=objectives[run["name"]])
        | dict(decisions[run["name"]], old=values[run["name"]])
        for run in runs
    ]
    kinds = [what for _, what in found.values() if what != "none"]
    entry = dict(round=r, step=boundary, objective=(kinds or ["none"])[0], members=members)
    append_round(sweep_dir, dict(entry, time=time.time()))
    return members


def copy_member(source: str, target: str):
    """A bottom member takes a top member's checkpoint (and its config.json, where it failed
    before writing its own), each file replaced whole."""
    os.makedirs(target, exist_ok=True)
    for name in (CHECKPOINT, CONFIG):
        if name == CHECKPOINT or not os.path.exists(os.path.join(target, CONFIG)):
            data = Path(source, name).read_bytes()
            checkpoints.write_atomically(os.path.join(target, name), data)


def read_rounds(sweep_dir: Path) -> list:
    """pbt.jsonl's rounds (a last line cut off by a crash left out)."""
    rounds = []
    try:
        with open(sweep_dir / PBT) as f:
            for line in f:
                try:
                    rounds.append(json.loads(line))
                except ValueError:
                    pass
    except FileNotFoundError:
        pass
    return rounds


def append_round(sweep_dir: Path, entry: dict):
    """One line of pbt.jsonl, written whole and synced before any checkpoint is copied."""
    with open(sweep_dir / PBT, "a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def pbt_slurm_script(args: LaunchArgs, common: list) -> str:
    """An sbatch script of one job that runs this launcher (without --slurm) in its allocation:
    the population's rounds need one process to rank and copy between them."""
    argv = [a for a in sys.argv[1:] if a != "--slurm"]
    output = shlex.quote(f"{Path(args.out) / args.name}/pbt_slurm.out")
    command = " ".join(shlex.quote(t) for t in [sys.executable, sys.argv[0], *argv])
    return "\n".join(
        [
            "#!/bin/bash",
            f"#SBATCH --job-name={shlex.quote(args.name)}",
            f"#SBATCH --output={output}",
            "",
            command,
            "",
        ]
    )


def summary(runs: list, stop: list) -> int:
    failed = [r for r in runs if r["state"] == "failed"]
    print(progress_line(runs, [], 1, 0).split("  (")[0])
    for run in failed:
        print(
            f"failed: {run['name']} (exit {run['exit_code']}); log: {run['log']}", file=sys.stderr
        )
    if stop:
        print(f"stopped by signal {stop[0]}: run the same command again to resume", file=sys.stderr)
        return 128 + stop[0]
    return 1 if failed else 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    run_tool(lambda args: main(args, argv[split + 1 :]), LaunchArgs, argv[:split])
