"""What the tools in utils/ share: the scripts they know, importing one, reading what a run wrote,
and the error convention (one `error: ...` line on stderr, exit code 2, no traceback).

The three training scripts never import this module (docs/DESIGN.md, rule 1); it imports them.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import flax.serialization
import tyro

REPO_ROOT = Path(__file__).resolve().parent.parent

# The training scripts whose checkpoints and runs the tools understand (file names in REPO_ROOT).
SCRIPTS = ("ppo_sync_baseline.py", "appo_envpool.py", "impala_envpool.py")

CHECKPOINT = "checkpoint.msgpack"
CONFIG = "config.json"
METRICS = "metrics.jsonl"


class UsageError(Exception):
    """A user's mistake: printed as one line, exit code 2, no traceback."""


def run_cli(main, config_class):
    """Parse `config_class` with tyro, call `main(config)` and exit with its code (2 on UsageError)."""
    config = tyro.cli(config_class)
    try:
        sys.exit(main(config))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def load_script(name: str):
    """Import one of SCRIPTS from the repository root by file name (nothing runs at import)."""
    if name not in SCRIPTS:
        raise UsageError(f"{name!r} is not one of the training scripts ({', '.join(SCRIPTS)})")
    return load_script_file(REPO_ROOT / name)


def load_script_file(path) -> object:
    """Import a training script (one of SCRIPTS or a user's copy) from its file; nothing runs at import."""
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
        raise UsageError(f"{path} cannot be imported ({type(e).__name__}: {e}); is it a training script?")
    return module


def checkpoint_file(path: str) -> str:
    """A run folder or a checkpoint file -> the checkpoint file (which may not exist)."""
    return os.path.join(path, CHECKPOINT) if os.path.isdir(path) else path


def read_checkpoint(path: str) -> dict:
    """The payload of a checkpoint written by a training script (one of SCRIPTS or a copy):
    {"state", "config" (a dict), "script" (its file name), maybe "script_path"}.

    UsageError if the file is missing, unreadable (corrupt, truncated) or not one of ours.
    """
    if not os.path.isfile(path):
        raise UsageError(f"no checkpoint at {path}; pass a run folder holding {CHECKPOINT}, or the file itself")
    try:
        with open(path, "rb") as f:
            payload = flax.serialization.msgpack_restore(f.read())
    except Exception as e:
        raise UsageError(f"{path} is not a readable checkpoint ({type(e).__name__}); it may be corrupt or truncated")
    missing = [key for key in ("state", "config", "script") if not isinstance(payload, dict) or key not in payload]
    if missing:
        raise UsageError(
            f"{path} is not a checkpoint of this project (no {', '.join(repr(k) for k in missing)} entry); "
            f"pass one written by {', '.join(SCRIPTS)}"
        )
    script = payload["script"]
    if not isinstance(script, str) or os.path.basename(script) != script or not script.endswith(".py"):
        raise UsageError(f"{path} names its script as {script!r}, which is not a script's file name")
    try:
        config = json.loads(payload["config"])
    except (TypeError, ValueError):
        config = None
    if not isinstance(config, dict) or not isinstance(config.get("env_id"), str) or not isinstance(payload["state"], dict):
        raise UsageError(f"{path} has no readable config (with an env_id) or state; it is not a checkpoint of this project")
    return dict(payload, config=config)


def run_identity(run_dir: str) -> dict:
    """{"script", "env_id", "seed"} of a run: from config.json (script = its exp_name, which
    defaults to the script's name), else from the checkpoint (the script's file name)."""
    config_file = os.path.join(run_dir, CONFIG)
    if os.path.isfile(config_file):
        try:
            with open(config_file) as f:
                config = json.load(f)
            return {"script": str(config["exp_name"]), "env_id": str(config["env_id"]), "seed": config.get("seed")}
        except (ValueError, KeyError, TypeError) as e:
            raise UsageError(f"{config_file} is not a run's config ({type(e).__name__}: {e})")
    ckpt = os.path.join(run_dir, CHECKPOINT)
    if not os.path.isfile(ckpt):
        raise UsageError(f"{run_dir} has neither {CONFIG} nor {CHECKPOINT}: which script and env wrote it is unknown")
    payload = read_checkpoint(ckpt)
    script = payload["script"][: -len(".py")]
    return {"script": script, "env_id": str(payload["config"].get("env_id")), "seed": payload["config"].get("seed")}
