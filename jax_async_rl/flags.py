"""Flags: the run flags every script shares (`RunArgs`, which a script's `Args` inherits), the
checks of a flag's range declared next to it, presets, and the command line itself.

A script declares a checked flag as `lr: Annotated[Optional[float], PRESET, POSITIVE] = None`:
`PRESET` fills it from the task's preset when left out, `POSITIVE` rejects 0, negative and
non-finite values with one line. `command_line(main, Args, PRESETS)` is the script's entry point:
parse, run, and turn a `UsageError` into one `error: ...` line on stderr and exit code 2.
"""

import contextlib
import dataclasses
import difflib
import errno
import io
import json
import math
import os
import re
import sys
import threading
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Optional

import tyro

from jax_async_rl import helptext  # --help; it reads RunArgs when called


class UsageError(Exception):
    """A user's mistake: printed as one line, exit code 2, no traceback."""


@dataclass(frozen=True)
class Bound:
    """A flag's allowed range, declared in its annotation: `test(value)` must hold."""

    test: typing.Callable
    says: str  # "must be positive", ... (out_of_range)


POSITIVE = Bound(lambda v: v > 0, "must be positive")
NON_NEGATIVE = Bound(lambda v: v >= 0, "must be >= 0")
UNIT = Bound(lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]")
# Every int flag fits in 32 bits: JAX computes with int32 (a jitted update takes the step and the
# budget), so a larger one would end in an overflow at the first update.
INT32 = 2**31 - 1


def at_most(limit) -> Bound:
    """A flag's upper limit: past it nothing sensible runs (an overflow, a loop or an allocation
    that no machine finishes)."""
    return Bound(
        lambda v: v <= limit,
        f"must be at most {limit:,}" if isinstance(limit, int) else f"must be at most {limit:g}",
    )


# Seeds of envs (int32 in envpool) are the seed plus env indices, and evaluation's seed + 10,000.
SEED = Bound(lambda v: 0 <= v <= 2**30, "must be in [0, 2**30]")


def default_is(text: str):
    """A flag's annotation: --help shows its default as `text` (for a default left at None)."""
    return tyro.conf.arg(help_behavior_hint=f"(default: {text})")


# Flags left at None take the value of the task's preset (the script's PRESETS).
PRESET = default_is("preset")
# Flags that no longer exist, and where their job went: one line instead of tyro's box.
RETIRED = {
    "xla_actor": "retired: the XLA actor is the script appo_envpool_xla.py now (APPO, always with "
    "that actor; "
    "IMPALA's is gone: port it from `diff appo_envpool.py appo_envpool_xla.py`)",
}

# Flags of some scripts, named to one that lacks them: where they are.
SELF_PLAY = (
    "self-play is in ppo_sync_baseline.py, appo_envpool.py and impala_envpool.py (envpool steps "
    "multi-player games on the CPU alone: no XLA step for appo_envpool_xla.py)"
)
ELSEWHERE = {
    name: SELF_PLAY
    for name in ("self_play", "opponent_mix", "opponent_snapshot_interval", "opponent_pool_size")
}


def flag_name(field: str) -> str:
    return field.replace("_", "-")


@dataclass
class RunArgs:
    """The flags of a run that no algorithm changes: task, budget, devices, folder, logs."""

    env_id: str = "Pong-v5"
    """envpool task id of any single-agent family with Discrete, continuous or multi-discrete
    actions (or your own Gymnasium env: see --env-module): Atari `*-v5`,
    classic control, Box2D (CarRacing-v3), MuJoCo, dm_control (CheetahRun-v1), MiniGrid and BabyAI,
    MetaWorld, MyoSuite, Gymnasium-Robotics (FetchReach-v1), highway-env, gfootball, toy text,
    Jumanji (several integers: one categorical over their product where the action mask is joint,
    else one a dimension; docs/families.md lists each task's), ..."""
    env_module: Optional[str] = None
    """import this module first: it registers --env-id, a Gymnasium env of yours (from the working
    directory or sys.path); or pass --env-id module:callable (a gymnasium.Env class or a
    function)"""
    env_kwargs: str = ""
    """keyword arguments of your Gymnasium env, as a JSON object, e.g. '{"length": 10}'"""
    env_timeout: Annotated[float, POSITIVE, at_most(7 * 86400.0)] = 300.0
    """seconds your Gymnasium env may take to answer a reset or step (its worker making it
    included) before the run stops and names it: a hung env"""
    trust_env_module: bool = False
    """with --resume: import the env module the run recorded (--env-module, or --env-id's module)
    without naming it again; a run folder is data, and runs no code you did not choose"""
    seed: Annotated[int, SEED] = 1
    """seed of the environments, the network initialisation and action sampling"""
    deterministic: bool = False
    """the run reproduces bit for bit from --seed on this machine (same JAX version, devices and
    flags): nothing it computes depends on timing (splits stepped in turn, the actor's parameters
    exactly those its schedule names; docs/DESIGN.md, Reproducibility)"""
    total_timesteps: Annotated[int, POSITIVE] = 10_000_000
    """training budget in environment (agent) steps, summed over all environments"""
    actor_device_ids: list[int] = dataclasses.field(default_factory=lambda: [0])
    """this process's devices that run the policy for the envs (indices into jax.local_devices())"""
    learner_device_ids: list[int] = dataclasses.field(default_factory=lambda: [0])
    """this process's devices that hold the parameters, replicated, and share each update's batch
    along the env axis: the gradient is the mean over the global batch (XLA all-reduces it)"""
    distributed: bool = False
    """join the run's other processes through jax.distributed; each runs this command with its own
    envs; all update in lockstep and process 0 alone writes the run folder"""
    coordinator_address: str = ""
    """with --distributed: host:port of process 0 (empty: detected from the cluster, e.g. SLURM)"""
    num_processes: Annotated[int, NON_NEGATIVE] = 0
    """with --distributed: the number of processes (0: detected from the cluster)"""
    process_id: Annotated[int, Bound(lambda v: v >= -1, "must be -1 (detected) or >= 0")] = -1
    """with --distributed: this process's index, 0 to num_processes - 1 (-1: detected)"""
    conv: Annotated[
        str, Bound(lambda v: v in ("auto", "matmul", "native"), "must be auto, matmul or native")
    ] = "auto"
    """the pixel torsos' convolutions: matmul (XLA's CPU convolution is several times slower
    than its matmul; docs/results.md), native (lax.conv_general_dilated), or auto: matmul on the
    CPU, native on a GPU or TPU. Both compute the same function of the same parameters"""
    compile_cache: str = dataclasses.field(
        default_factory=lambda: os.path.join(
            os.environ.get("XDG_CACHE_HOME", "~/.cache"), "jax-async-rl"
        )
    )
    """folder of JAX's persistent compilation cache: a later run of the same configuration skips
    most of XLA's compile (the Atari update's takes minutes on a CPU); '' turns it off"""
    exp_name: Annotated[Optional[str], default_is("the script's file name")] = None
    """experiment name, part of the run folder's name"""
    run_dir: Annotated[Optional[str], default_is("runs/{env_id}__{exp_name}__{seed}__{time}")] = (
        None
    )
    """output folder; one that holds another run is refused (continue that one with --resume)"""
    resume: Optional[str] = None
    """continue this run folder (or checkpoint file) with its own flags; flags given here replace
    them, except --env-id, --norm-obs and --norm-reward, which cannot change mid-run"""
    pause_at: Annotated[int, NON_NEGATIVE] = 0
    """stop with a checkpoint at the first update at or past this env step, the schedules still
    set by --total-timesteps, and exit 0 without the final evaluation (what utils/launch.py --pbt
    ends each round with; 0: never); --resume goes on from there"""
    save_interval: Annotated[int, NON_NEGATIVE] = 50
    """write a checkpoint every this many updates (0: only at the end)"""
    log_frequency: Annotated[int, POSITIVE] = 10
    """log losses, timings and SPS every this many updates and after the last (returns: always)"""
    eval_episodes: Annotated[
        Optional[int], NON_NEGATIVE, at_most(100_000), default_is("10; 1000 with --self-play")
    ] = None
    """episodes played with the final policy at the end of training (0: no evaluation), and at
    each --eval-interval; with --self-play, games against the uniform random player, seats
    alternating"""
    eval_interval: Annotated[int, NON_NEGATIVE] = 0
    """also evaluate during training (0: only at the end): the parameters of the update that
    crosses each multiple of this many env steps play --eval-episodes full games on envs of their
    own with the evaluation policy, logged as eval/* at that update's step; the asynchronous
    scripts play them in a thread beside the actor and the learner"""
    capture_video: bool = False
    """record an mp4 of one evaluation episode into {run_dir}/videos/"""
    track: bool = False
    """also log to Weights & Biases (needs `pip install wandb`, or the project's `wandb` extra)"""
    wandb_project: str = "jax-async-rl"
    """Weights & Biases project, with --track"""


def with_preset(args, values: dict):
    """`args` with the flags left at None set from `values` (a preset); an explicit flag wins."""
    return dataclasses.replace(
        args, **{k: v for k, v in values.items() if getattr(args, k) is None}
    )


def check_bounds(args):
    """UsageError (one line naming the flag) for the first flag outside the range its annotation
    declares (POSITIVE, NON_NEGATIVE, UNIT, at_most, ...), a non-finite float flag or an int flag
    past 32 bits (INT32)."""
    hints = typing.get_type_hints(type(args), include_extras=True)
    for field in dataclasses.fields(args):
        wrong = out_of_range(hints[field.name], getattr(args, field.name))
        if wrong:
            raise UsageError(f"--{flag_name(field.name)} {wrong[0]}, got {wrong[1]}")


def out_of_range(hint, value):
    """(what `value`, a flag annotated `hint`, must be, the value as said) where it is outside a
    range the annotation declares, a non-finite float or an int past 32 bits; else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number", value
    for bound in getattr(hint, "__metadata__", ()):
        if isinstance(bound, Bound) and value is not None and not bound.test(value):
            return bound.says, value
    for number in value if isinstance(value, (list, tuple)) else [value]:
        if type(number) is int and abs(number) > INT32:
            return f"must be at most {INT32:,} (int flags are 32-bit, as JAX counts)", f"{number:,}"
    return None


def from_json(hint, value):
    """`value`, read from a file's JSON, as a flag annotated `hint` (int, float, bool, str,
    Optional, list, tuple) holds it: an int as a float, a list as a tuple. TypeError
    saying what it must be where it is of another type; an annotation this does not know takes
    any value."""
    kind = typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint
    origin, inner = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in inner:
            return None
        for option in (option for option in inner if option is not type(None)):
            try:
                return from_json(option, value)
            except TypeError:
                pass
        raise TypeError(" or ".join(type_words(option) for option in inner))
    if origin in (list, tuple) and isinstance(value, (list, tuple)):  # list[int], tuple[float, ...]
        try:
            return origin(from_json(inner[0], element) for element in value)
        except TypeError:
            raise TypeError(type_words(kind)) from None
    if origin is None and (type(value) is kind or kind is float and type(value) is int):
        # JSON's 3 is a float flag's 3.0; True is not an int
        return float(value) if kind is float else value
    if origin in (list, tuple) or kind in (bool, int, str, float):
        raise TypeError(type_words(kind))
    return value


def type_words(kind) -> str:
    """A flag's type (an annotation), as an error says what a value must be."""
    origin, inner = typing.get_origin(kind), typing.get_args(kind)
    if origin in (list, tuple):
        return f"a list ({type_words(inner[0])} each)"
    words = {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        type(None): "null",
    }
    return words.get(kind, getattr(kind, "__name__", str(kind)))


def stored_flags(args_class, config: dict, where: str) -> dict:
    """`config` (flags read from a file anyone may have written: a checkpoint's) as `args_class`
    holds them (from_json), once each passes the checks of the command line's (out_of_range).
    UsageError, one line naming `where` (the file) and the key, for the first that does not."""
    hints = typing.get_type_hints(args_class, include_extras=True)
    typed = {}
    for name, value in config.items():
        said = json.dumps(value)
        said = said if len(said) <= 60 else said[:57] + "..."
        try:
            typed[name] = from_json(hints[name], value)
        except TypeError as e:
            raise UsageError(f"{where}: its config has {name} {said}: must be {e}") from None
        wrong = out_of_range(hints[name], typed[name])
        if wrong:
            raise UsageError(f"{where}: its config has {name} {said}: {wrong[0]}")
    return typed


def default_exp_name(stem: str, args) -> str:
    """--exp-name left out: the script's name (`stem`) and the names of the variants the flags
    make (the script's `Args.NAMED`: {name: {flag: value}}, e.g. TD3's `ddpg`, the replay
    scripts' `serial`), so that runs of two variants are told apart by their folders and headers."""
    named = [
        name
        for name, values in getattr(type(args), "NAMED", {}).items()
        if all(getattr(args, flag) == value for flag, value in values.items())
    ]
    return "__".join([stem, *named])


def budget_note(args, given, step: int, batch: int, batch_text: str):
    """The line saying what a --total-timesteps named on the command line (`given`; None: one
    that differs from the default) trains from `step` when it is not a whole number of updates of
    `batch`, else None (a default's remainder is no number the user chose)."""
    named = (
        "total_timesteps" in given
        if given is not None
        else args.total_timesteps != type(args)().total_timesteps
    )
    if not named or (args.total_timesteps - step) % batch == 0:
        return None
    updates = (args.total_timesteps - step) // batch
    return (
        f"note: --total-timesteps {args.total_timesteps} is not a whole number of updates of "
        f"{batch_text}: "
        f"{updates} updates will train, to step {step + updates * batch}"
    )


def flags_given(argv, args_class) -> set:
    """The Args fields named on a command line (`--flag value`, `--flag=value`, `--no-flag`)."""
    fields = {f.name for f in dataclasses.fields(args_class)}
    names = {token[2:].split("=")[0].replace("-", "_") for token in argv if token.startswith("--")}
    return {name for name in names if name in fields} | {
        name[3:] for name in names if name.startswith("no_") and name[3:] in fields
    }


def check_names(argv, args_class):
    """UsageError for a flag this script does not have: where a retired flag's job went, or the
    nearest names (tyro's own message is a box of many lines)."""
    fields = [f.name for f in dataclasses.fields(args_class)]
    for token in argv:
        if token == "--":  # what follows is not flags
            return
        if not token.startswith("--"):
            continue
        name = token[2:].split("=")[0].replace("-", "_")
        if name in fields or name.startswith("no_") and name[3:] in fields:
            continue
        if name in RETIRED or name.startswith("no_") and name[3:] in RETIRED:
            raise UsageError(f"{token.split('=')[0]}: {RETIRED[name.removeprefix('no_')]}")
        if name.removeprefix("no_") in ELSEWHERE:
            raise UsageError(f"{token.split('=')[0]}: {ELSEWHERE[name.removeprefix('no_')]}")
        close = difflib.get_close_matches(name, fields, n=2, cutoff=0.6)
        hint = f"; did you mean {' or '.join('--' + flag_name(c) for c in close)}?" if close else ""
        raise UsageError(f"unknown flag {token.split('=')[0]}{hint} (--help lists them)")


FILE_SYSTEM_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EROFS,
    errno.EIO,
    errno.EACCES,
    errno.ENOENT,
}


def is_file_system_error(error) -> bool:
    """A full disk, a read-only, forbidden or vanished folder: an OSError that names a file, or
    whose errno says so."""
    return isinstance(error, OSError) and (
        bool(error.filename) or error.errno in FILE_SYSTEM_ERRNOS
    )


def describe_os_error(error: OSError) -> str:
    """One line for a file system error: what failed, and where."""
    where = f"{error.filename or 'a file'}" + (f" -> {error.filename2}" if error.filename2 else "")
    return f"{error.strerror or type(error).__name__}: {where}"


def parse(config_class, argv, description=None):
    """tyro's parse of `argv` into `config_class`; what tyro rejects (a value that does not parse, a
    value too many, a positional missing) is one UsageError line, not tyro's box of many lines."""
    said, columns = io.StringIO(), os.environ.get("COLUMNS")
    # tyro wraps its box at the terminal's width: a path would break
    os.environ["COLUMNS"] = "100000"
    try:
        with contextlib.redirect_stderr(said):
            args = tyro.cli(config_class, args=argv, description=description)
    except SystemExit as e:
        message = box_message(said.getvalue())
        if not e.code or not message:  # a layout this does not read: as tyro printed it
            sys.stderr.write(said.getvalue())
            raise
        # `--resume runs/x*/` where the glob matched 2 folders
        if message.startswith("Unrecognized options:"):
            message += " (one value too many: did a glob match several folders?)"
        raise UsageError(f"{message}; --help lists the flags") from None
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    sys.stderr.write(said.getvalue())  # what tyro says of a parse that succeeds (a warning)
    return args


def box_message(text: str) -> str:
    """The message of tyro's error box: its lines after the title, up to the first rule, in either
    layout (box-drawing characters, or spaces and dashes where the stream is not a UTF-8 one), the
    colours (where stdout is a terminal) removed; "" where there is none."""
    blocks, block = [], []
    for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines():
        line = line.strip(" │╭╰╮╯")
        if line.strip("─-"):
            block.append(line.strip("─ "))
        elif block:
            blocks, block = [*blocks, block], []
    blocks += [block] * bool(block)
    message = (
        blocks[0][1:] if blocks and len(blocks[0]) > 1 else blocks[1] if len(blocks) > 1 else []
    )
    return " ".join(message)


def reported(call) -> int:
    """`call()`'s exit code; a UsageError is one line on stderr and exit code 2, a file system
    error (a full disk, a read-only or vanished folder) one line naming the path and exit code 1."""
    try:
        return call()
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if not is_file_system_error(e):
            raise
        print(f"error: {describe_os_error(e)}", file=sys.stderr)
        return 1


def command_line(main, args_class, presets: dict):
    """A script's entry point: parse its flags, run `main(args, given)`, exit with its code (see
    `reported` for errors), by `exit_with`."""
    argv = sys.argv[1:]

    def call():
        if {"-h", "--help"} & set(argv[: argv.index("--") if "--" in argv else len(argv)]):
            try:
                text = helptext.help_text(os.path.basename(sys.argv[0]), args_class, presets)
            except Exception:  # an Args this layout does not know (a user's edit): tyro's own help
                tyro.cli(
                    args_class,
                    args=argv,
                    description=helptext.describe_presets(args_class, presets),
                )
            print(text, end="")
            return 0
        check_names(argv, args_class)
        return main(
            parse(args_class, argv, helptext.describe_presets(args_class, presets)),
            flags_given(argv, args_class),
        )

    exit_with(reported(call))


def exit_with(exit_code: int):
    """Exit; by os._exit where a run's thread is still in an XLA call (interpreter shutdown would
    abort)."""
    if any(
        t.name.startswith(("actor", "learner", "training loop")) and t.is_alive()
        for t in threading.enumerate()
    ):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
    sys.exit(exit_code)


def run_tool(main, config_class, argv=None):
    """A tool's entry point (utils/): parse `argv` (the command line's) into `config_class`, exit
    with `main(config)`'s code (see `reported`); --help as the scripts' (`help_text`)."""
    argv = sys.argv[1:] if argv is None else argv

    def call():
        if {"-h", "--help"} & set(argv):
            print(helptext.help_text(os.path.basename(sys.argv[0]), config_class, {}), end="")
            return 0
        check_names(argv, config_class)
        return main(parse(config_class, argv))

    sys.exit(reported(call))
