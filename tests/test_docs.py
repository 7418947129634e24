"""The README and docs/: every relative link and anchor resolves, every flag they name and every
command they show exists as written, and what they say that comes from the code (a flag's
default, the lines a diff adds) is what the code says. Measured figures (a mean ± std) are the
ones docs/results.md holds with their commands; test counts are not written."""

import dataclasses
import re
import subprocess
import unicodedata

import pytest

from helpers import REPO_ROOT, load_script

SCRIPTS = [
    "ppo_sync_baseline.py",
    "appo_envpool.py",
    "appo_envpool_xla.py",
    "impala_envpool.py",
    "dqn_envpool.py",
    "sac_envpool.py",
    "td3_envpool.py",
]
TOOLS = {
    "utils/benchmark.py": "Args",
    "utils/evaluate.py": "EvalArgs",
    "utils/launch.py": "LaunchArgs",
    "utils/plot.py": "PlotArgs",
}
# The scripts a page is about: a default it states must be theirs (elsewhere: every script's with
# the flag).
PAGE_SCRIPTS = {
    "docs/algorithms/ppo.md": SCRIPTS[:3],
    "docs/algorithms/impala.md": ["impala_envpool.py"],
    "docs/algorithms/dqn.md": ["dqn_envpool.py"],
    "docs/algorithms/sac_td3.md": SCRIPTS[5:],
}
PAGES = sorted(
    [REPO_ROOT / "README.md", REPO_ROOT / "CONTRIBUTING.md", *(REPO_ROOT / "docs").rglob("*.md")]
)
# Flags every program has, and other programs' that the docs name (pytest's, tensorboard's,
# py-spy's).
OTHER_FLAGS = {"help", "timeout", "dist", "logdir", "gil"}


def page_id(path) -> str:
    return str(path.relative_to(REPO_ROOT))


def prose(text: str) -> str:
    """`text` without its fenced code blocks (links and headings inside them are not links)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def commands(text: str) -> list:
    """The shell lines of a page's code blocks and inline code, continuation lines joined."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.S | re.M)
    inline = [
        " ".join(code.split())
        for code in re.findall(r"`([^`]+)`", prose(text))
        if "python " in code
    ]
    return [
        line.split(" #")[0] for line in "\n".join(blocks).replace("\\\n", " ").splitlines() + inline
    ]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to
    hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(path) -> set:
    text = prose(path.read_text())
    seen, out = {}, set()
    for heading in re.findall(r"^#{1,6} +(.*?) *#*$", text, flags=re.M):
        base = slug(heading)
        out.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return out | set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", text))


def defaults(files) -> dict:
    """{flag: {file: its default}} of the scripts and tools `files` (a preset's flag: "preset")."""
    out = {}
    for name in files:
        module = load_script(REPO_ROOT / name)
        for field in dataclasses.fields(getattr(module, TOOLS.get(name, "Args"))):
            value = (
                field.default
                if field.default_factory is dataclasses.MISSING
                else field.default_factory()
            )
            out.setdefault(field.name.replace("_", "-"), {})[name] = (
                "preset" if value is None else value
            )
    return out


@pytest.fixture(scope="module")
def flags_of():
    return {name: defaults([name]) for name in [*SCRIPTS, *TOOLS]}


def test_the_readme_is_read_in_five_minutes():
    """CleanRL's README is about 200 lines; what is longer belongs in docs/."""
    lines = len((REPO_ROOT / "README.md").read_text().splitlines())
    assert lines <= 250, f"README.md: {lines} lines"


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_every_relative_link_and_anchor_resolves(path):
    text = re.sub(r"`[^`\n]*`", "", prose(path.read_text()))
    targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(
        r"<(?:img|a) [^>]*(?:src|href)=\"([^\"]+)\"", text
    )
    broken = []
    for target in targets:
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(target)
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
            broken.append(target)
    assert not broken, f"{page_id(path)}: {broken}"


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_every_flag_and_command_exists_as_written(path, flags_of):
    """A flag named in prose is some script's or tool's; a command's flags are its program's (after
    utils/launch.py's `--`, the trained script's)."""
    text = path.read_text()
    every = {flag for table in flags_of.values() for flag in table} | OTHER_FLAGS
    every |= {f"no-{flag}" for flag in every}
    spans = [code for code in re.findall(r"`([^`]+)`", prose(text)) if "python " not in code]
    named = {
        flag
        for code in spans
        for flag in re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)(?![\w])", code)
    }
    assert named <= every, f"{page_id(path)} names flags no script has: {sorted(named - every)}"
    wrong = []
    for line in commands(text):
        for program, rest in re.findall(r"python (\S+\.py)((?: [^|&;]*)?)", line):
            program = program.removeprefix("~/jax-async-rl/")
            if program not in flags_of:
                continue
            own, _, after = rest.partition(" -- ")
            trained = next((t for t in own.split() if t.endswith(".py")), None)
            checked = [(flags_of[program], own)] + (
                [(flags_of[trained], after)] if trained in flags_of else []
            )
            for (
                flags,
                tokens,
            ) in checked:  # after `--`: a script named in words (SCRIPT) is not checked
                known = set(flags) | {f"no-{f}" for f in flags} | OTHER_FLAGS
                wrong += [
                    (program, t)
                    for t in re.findall(r"(?<!\S)--([a-z][a-z0-9-]*)", tokens)
                    if t not in known
                ]
    assert not wrong, f"{page_id(path)}: commands with flags their program does not have: {wrong}"


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_a_default_the_docs_state_is_the_codes(path):
    """ "`--flag` ... (default VALUE)": VALUE is the flag's default in every script of the page
    (PAGE_SCRIPTS; elsewhere every script and tool with the flag)."""
    text = prose(path.read_text())
    table = defaults(PAGE_SCRIPTS.get(page_id(path), [*SCRIPTS, *TOOLS]))
    wrong = []
    for flag, value in re.findall(
        r"`--([a-z0-9-]+)`(?:(?!`--)[^.;]){0,60}?\(default:? `?(\d{1,3}(?:,\d{3})+|[^,;)`\s]+)",
        text,
    ):
        if flag not in table or not re.fullmatch(r"-?[\d,]+(\.\d*)?(e-?\d+)?|True|False", value):
            continue  # a default in words (a path, "the cores") is not checked
        literal = {"True": True, "False": False}.get(value, value.replace(",", ""))
        for name, default in table[flag].items():
            if str(default) != str(literal) and not (
                isinstance(default, float) and float(literal) == default
            ):
                wrong.append(f"--{flag} (default {value}): {name} says {default}")
    assert not wrong, f"{page_id(path)}: {wrong}"


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_diff_sizes_are_the_diffs(path):
    """A line that shows `diff A B` and says it "adds N" lines: N is what the diff adds."""
    wrong = []
    for old, new, count in re.findall(
        r"diff (\S+\.py) (\S+\.py)\b[^\n]*?\badds (\d[\d,]*)", path.read_text()
    ):
        result = subprocess.run(
            ["diff", REPO_ROOT / old, REPO_ROOT / new], capture_output=True, text=True
        )
        added = sum(line.startswith(">") for line in result.stdout.splitlines())
        if added != int(count.replace(",", "")):
            wrong.append(f"diff {old} {new} adds {added}, not {count}")
    assert not wrong, f"{page_id(path)}: {wrong}"


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_no_test_counts(path):
    """The number of tests changes with every commit: pytest prints it."""
    assert not re.search(r"\b\d[\d,]* tests\b(?!/)", path.read_text()), page_id(path)


def test_measured_figures_are_the_results_pages():
    """Every mean ± std in the README, the algorithm pages and the parity study is one that
    docs/results.md holds (with the command that measured it)."""
    results = (REPO_ROOT / "docs" / "results.md").read_text()
    figure = r"-?\d[\d,.]*(?:\.\d+)? ± \d[\d,.]*\d"
    missing = []
    for path in [
        REPO_ROOT / "README.md",
        REPO_ROOT / "docs" / "parity.md",
        *(REPO_ROOT / "docs" / "algorithms").glob("*.md"),
    ]:
        missing += [
            (page_id(path), f) for f in re.findall(figure, path.read_text()) if f not in results
        ]
    assert not missing, missing
