"""--help: the scripts' and tools' help text (usage, description, arguments, flags grouped with
their defaults and the presets' values), and `help_from_source`, which prints a script's help
from its source without the imports that take seconds (JAX, flax, envpool)."""

import ast
import dataclasses
import inspect
import os
import sys
import textwrap
import types
import typing

import tyro

# --help's groups: flags not named here are the algorithm's (or, in flags.RunArgs, the run's).
ENVIRONMENT = (
    "env_id",
    "env_module",
    "env_kwargs",
    "env_timeout",
    "trust_env_module",
    "seed",
    "num_envs",
    "num_splits",
    "num_threads",
    "norm_obs",
    "norm_reward",
)
DEVICES = (
    "actor_device_ids",
    "learner_device_ids",
    "num_actor_threads",
    "distributed",
    "coordinator_address",
    "num_processes",
    "process_id",
)


def field_docs(cls) -> dict:
    """{field: the docstring under it} of a dataclass and its bases, read from their source."""
    docs = {}
    for klass in reversed(cls.__mro__[:-1]):
        try:
            body = getattr(
                ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0], "body", None
            )
        except Exception:  # no source (an interactive class), or not one block
            continue
        if not isinstance(body, list):
            continue
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
            ):
                docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def metavar(hint) -> str:
    """A plain metavar for a type hint: INT, FLOAT, STR, INT..., True|False."""
    args = [a for a in typing.get_args(hint) if a is not type(None) and a is not Ellipsis]
    if typing.get_origin(hint) is typing.Literal:
        return "{" + ",".join(map(str, args)) + "}"
    if typing.get_origin(hint) in (list, tuple):
        return metavar(args[0]) + "..."
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return "True|False" if args[0] is bool else metavar(args[0])
    return {int: "INT", float: "FLOAT", str: "STR", bool: ""}.get(hint, "VALUE")


POSITIONAL = typing.get_args(tyro.conf.Positional[int])[
    1
]  # tyro's mark of an argument given without a flag


def help_text(prog: str, args_class, presets: dict) -> str:
    """--help: the description and presets, then the arguments and the flags in groups (a
    script's: algorithm, environment, run, devices; a tool's: one), each with a plain metavar, its
    meaning and its default, wrapped to 100 columns."""
    docs, hints = field_docs(args_class), typing.get_type_hints(args_class, include_extras=True)
    # A script's Args inherits flags.RunArgs (found by name: flags imports this module, not the
    # reverse)
    run_args = [
        k
        for k in args_class.__mro__
        if (k.__module__, k.__name__) == ("jax_async_rl.flags", "RunArgs")
    ]
    run_fields, script = {f.name for k in run_args for f in dataclasses.fields(k)}, bool(run_args)
    groups = {
        "arguments": [],
        "algorithm flags": [],
        "environment flags": [],
        "run flags": [],
        "devices flags": [],
        "flags": [],
    }
    for field in dataclasses.fields(args_class):
        name, meta = field.name, getattr(hints[field.name], "__metadata__", ())
        hint = (
            hints[name].__origin__
            if typing.get_origin(hints[name]) is typing.Annotated
            else hints[name]
        )
        label = next((m.metavar for m in meta if getattr(m, "metavar", None)), None) or metavar(
            hint
        )
        shown = [m.help_behavior_hint for m in meta if getattr(m, "help_behavior_hint", None)]
        value = (
            field.default
            if field.default_factory is dataclasses.MISSING
            else field.default_factory()
        )
        default = (
            shown[0]
            if shown
            else f"(default: {value!r})"
            if isinstance(value, str)
            else f"(default: {value})"
        )
        if POSITIONAL in meta:
            group, flag, default = "arguments", label, ""
        else:
            group = (
                "flags"
                if not script
                else "environment flags"
                if name in ENVIRONMENT
                else "devices flags"
                if name in DEVICES
                else "run flags"
                if name in run_fields
                else "algorithm flags"
            )
            flag = f"--{name.replace('_', '-')}" + (
                f" / --no-{name.replace('_', '-')}" if hint is bool else f" {label}"
            )
            default = "(required)" if value is dataclasses.MISSING else default
        text = textwrap.fill(
            f"{docs.get(name, '')} {default}".strip(),
            100,
            initial_indent=" " * 6,
            subsequent_indent=" " * 6,
        )
        groups[group].append(f"  {flag}\n{text}")
    preset_lines = [
        textwrap.fill(
            f"{name}: " + ", ".join(f"{k}={v}" for k, v in values.items()),
            100,
            initial_indent="  ",
            subsequent_indent="      ",
        )
        for name, values in presets.items()
    ]
    paragraphs = inspect.cleandoc(args_class.__doc__).split("\n\n")
    description = "\n\n".join(textwrap.fill(" ".join(p.split()), 100) for p in paragraphs)
    arguments = "".join(f"{entry.split(chr(10))[0].strip()} " for entry in groups["arguments"])
    out = [
        f"usage: {prog} {arguments}[--flag VALUE ...]",
        "",
        description,
        *(["", "presets:", *preset_lines] if presets else []),
    ]
    for group, entries in groups.items():
        if entries:
            out += ["", f"{group}:", *entries]
    return "\n".join([*out, "", "  -h, --help\n      show this help and exit"]) + "\n"


def light_import(node, needed: set):
    """An import statement cut to the names in `needed` that come from the standard library or
    jax_async_rl.flags (nothing that imports JAX, flax or envpool); None when none is left."""

    def light(module, name):
        return module.split(".")[0] in sys.stdlib_module_names or "jax_async_rl.flags" in (
            module,
            f"{module}.{name}",
        )

    if isinstance(node, ast.Import):
        kept = [
            a
            for a in node.names
            if (a.asname or a.name.split(".")[0]) in needed and light(a.name, "")
        ]
    else:
        kept = [
            a
            for a in node.names
            if (a.asname or a.name) in needed and node.level == 0 and light(node.module, a.name)
        ]
    return type(node)(**{**vars(node), "names": kept}) if kept else None


def bound_names(node) -> set:
    """The module-level names a statement of a script defines (a class, a function, an
    assignment's targets)."""
    if isinstance(node, ast.ClassDef | ast.FunctionDef):
        return {node.name}
    targets = (
        node.targets
        if isinstance(node, ast.Assign)
        else [node.target]
        if isinstance(node, ast.AnnAssign)
        else []
    )
    return {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}


def help_from_source(path: str):
    """--help before a script imports its libraries (JAX, flax, envpool: seconds): when -h or --help
    is among the flags, run only what `Args` and `PRESETS` need of the script's source (its light
    imports, then the module-level definitions those names use, in source order), print
    `help_text` and exit 0. On any failure it returns, and the script's command line prints the
    same help after its imports (an Args edited to need JAX costs only the time)."""
    argv = sys.argv[1:]
    if not {"-h", "--help"} & set(argv[: argv.index("--") if "--" in argv else len(argv)]):
        return
    # field_docs reads the file through it
    module = types.ModuleType(f"_help_source_{abs(hash(path))}")
    module.__file__ = path
    try:
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        definitions = [(node, bound_names(node)) for node in tree.body]
        needed, chosen = {"Args", "PRESETS"}, []
        while True:
            new = [node for node, bound in definitions if bound & needed and node not in chosen]
            if not new:
                break
            chosen += new
            needed |= {n.id for node in new for n in ast.walk(node) if isinstance(n, ast.Name)}
        imports = [
            light_import(node, needed)
            for node in tree.body
            if isinstance(node, ast.Import | ast.ImportFrom)
        ]
        body = sorted([node for node in imports if node] + chosen, key=lambda node: node.lineno)
        sys.modules[module.__name__] = module
        exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), module.__dict__)
        text = help_text(os.path.basename(sys.argv[0]), module.Args, module.PRESETS)
    # what Args needs is more than this runs: the script's own path prints the help
    except Exception:
        return
    finally:
        sys.modules.pop(module.__name__, None)
    print(text, end="")
    sys.exit(0)


def describe_presets(args_class, presets: dict) -> str:
    """--help's description: the Args docstring and the values each preset gives."""
    lines = [
        f"  {name}: " + ", ".join(f"{k}={v}" for k, v in values.items())
        for name, values in presets.items()
    ]
    return "\n".join(
        [inspect.cleandoc(args_class.__doc__), *(["", "Presets:", *lines] if lines else [])]
    )
