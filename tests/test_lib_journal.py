"""jax_async_rl.journal, and the run folder as a boundary: a --deterministic resume replays only the
journal of actions that its checkpoint records (its sha256), each action in the action space,
and a run never reads or writes through a link that it finds in its folder (a run folder may
come from anyone). The library's functions here, and one tiny real run resumed with each damage:
one line, exit 2, before anything is written."""

import hashlib
import os
import shutil

import flax.serialization
import gymnasium
import jax
import numpy as np
import pytest

from helpers import CHECKPOINT, cli, run_main
from jax_async_rl import checkpoints, folders, journal
from jax_async_rl.flags import UsageError
from jax_async_rl.logs import Logger

SHAPE = (3, 2)  # an update's actions: T = 3 steps of B = 2 envs
ACTIONS = np.arange(2 * 6).reshape(2, *SHAPE) % 4  # 2 updates of Discrete(4) actions


def kept(run_dir, updates=ACTIONS):
    """A journal of `updates` appended as a run appends them; the checkpoint's record of it."""
    keeper = journal.Journal(str(run_dir), np.zeros(SHAPE, np.int64))
    for actions in updates:
        keeper.append(actions)
    keeper.sync()
    keeper.close()
    return keeper.digest(len(updates))


def test_a_checkpoint_records_the_journal_up_to_its_update(tmp_path):
    """The record is the sha256 of the updates' bytes, also where more were appended after it
    (a run stopped between an update's rollout and its checkpoint), and after a resume's read
    (which cuts the journal back to the checkpoint's updates)."""
    record = kept(tmp_path)
    data = (tmp_path / journal.JOURNAL).read_bytes()
    assert record == {
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
        "shape": str(list(SHAPE)),
    }
    with open(
        tmp_path / journal.JOURNAL, "ab"
    ) as f:  # a run stopped after an update's rollout, before its checkpoint
        f.write(ACTIONS[0].tobytes())
    resumed = journal.Journal(str(tmp_path), np.zeros(SHAPE, np.int64))
    np.testing.assert_array_equal(resumed.read(2, record, gymnasium.spaces.Discrete(4)), ACTIONS)
    assert (tmp_path / journal.JOURNAL).read_bytes() == data  # cut back to the checkpoint's
    resumed.append(ACTIONS[1])
    resumed.sync()
    assert (
        resumed.digest(3)["sha256"]
        == hashlib.sha256((tmp_path / journal.JOURNAL).read_bytes()).hexdigest()
    )
    assert resumed.digest(2) == record  # more appended than the checkpoint learned from
    resumed.close()


def damage(path, how, elsewhere):
    if how == "random bytes":
        path.write_bytes(np.random.default_rng(0).bytes(path.stat().st_size))
    elif how == "inverted":
        path.write_bytes((3 - np.frombuffer(path.read_bytes(), np.int64)).tobytes())
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:-8])
    elif how == "missing":
        path.unlink()
    elif how == "a link":
        elsewhere.write_bytes(path.read_bytes())
        path.unlink()
        path.symlink_to(elsewhere)
    elif how == "a FIFO":
        path.unlink()
        os.mkfifo(path)


@pytest.mark.parametrize(
    "how, fragment",
    [
        ("random bytes", "sha256 differs"),
        ("inverted", "sha256 differs"),
        ("truncated", "fewer than"),
        ("missing", "missing"),
        ("a link", "not a regular file"),
        ("a FIFO", "not a regular file"),
    ],
)
def test_a_journal_that_is_not_the_checkpoints_is_refused(tmp_path, how, fragment):
    """Refused in one UsageError that names the file and --no-deterministic; never cut; a link's
    target untouched."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run_dir.mkdir()
    record = kept(run_dir)
    path = run_dir / journal.JOURNAL
    damage(path, how, elsewhere)
    before = path.read_bytes() if path.is_file() and not path.is_symlink() else None
    target = elsewhere.read_bytes() if how == "a link" else None
    with pytest.raises(UsageError, match=fragment) as e:
        journal.verify(
            str(run_dir), {"journal": record}, 2, SHAPE, np.int64, gymnasium.spaces.Discrete(4)
        )
    assert "--no-deterministic" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UsageError, match=fragment):
        journal.Journal(str(run_dir), np.zeros(SHAPE, np.int64)).read(
            2, record
        )  # Keeper's read: never cut
    if before is not None:
        assert path.read_bytes() == before
    if target is not None:
        assert elsewhere.read_bytes() == target


def test_a_journal_of_another_shape_is_refused_though_its_bytes_match(tmp_path):
    """--num-envs 8 --num-steps 16 resuming a run of 4 x 32 (the same bytes an update): the record's
    shape refuses it; a record from before shapes were kept checks the size alone."""
    record = kept(tmp_path)
    with pytest.raises(UsageError, match=r"other --num-envs or --num-steps .*\[3, 2\].*\[2, 3\]"):
        journal.verify(
            str(tmp_path),
            {"journal": record},
            2,
            SHAPE[::-1],
            np.int64,
            gymnasium.spaces.Discrete(4),
        )
    older = {k: v for k, v in record.items() if k != "shape"}
    journal.verify(
        str(tmp_path), {"journal": older}, 2, SHAPE[::-1], np.int64, gymnasium.spaces.Discrete(4)
    )


@pytest.mark.parametrize(
    "space, bad",
    [
        (gymnasium.spaces.Discrete(3), 3),
        (gymnasium.spaces.Discrete(3), -1),
        (gymnasium.spaces.MultiDiscrete([4, 2]), [0, 2]),
        (gymnasium.spaces.Box(-1, 1, (2,), np.float32), [0.0, np.nan]),
        (gymnasium.spaces.Box(-1, 1, (2,), np.float32), [np.inf, 0.0]),
    ],
)
def test_every_replayed_action_is_in_the_action_space(tmp_path, space, bad, capsys):
    """A checkpoint from before journals were recorded (no digest): a note, then each action is
    checked against the action space (discrete in [0, n), multi-discrete per nvec, continuous
    finite): one UsageError naming the update."""
    example = np.zeros((3, 2, *space.shape), space.dtype)
    good = journal.Journal(str(tmp_path), example)
    good.append(example)
    wrong = example.copy()
    wrong[1, 1] = bad
    good.append(wrong)
    good.close()
    journal.verify(str(tmp_path), {"acting": {}}, 1, example.shape, space.dtype, space)
    assert "records no digest" in capsys.readouterr().err
    with pytest.raises(UsageError, match=r"outside .* \(update 1\)"):
        journal.verify(str(tmp_path), {"acting": {}}, 2, example.shape, space.dtype, space)


def test_a_run_writes_no_file_through_a_link_in_its_folder(tmp_path):
    """The temporary files (config.json.tmp, checkpoint.msgpack.tmp, metrics.jsonl.tmp), the lock,
    the journal, metrics.jsonl and the event files: a link planted in the folder is never
    written through (a temporary file is made anew beside it), and check_files names it."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run_dir.mkdir()
    elsewhere.write_bytes(b"someone else's file\n")
    for name in (f"{checkpoints.CONFIG}.tmp", f"{CHECKPOINT}.tmp", f"{checkpoints.METRICS}.tmp"):
        (run_dir / name).symlink_to(elsewhere)
        checkpoints.write_atomically(str(run_dir / name[: -len(".tmp")]), b"the run's\n")
        assert (run_dir / name[: -len(".tmp")]).read_bytes() == b"the run's\n" and not (
            run_dir / name
        ).exists()
    (run_dir / folders.LOCK).symlink_to(elsewhere)
    with pytest.raises(OSError):
        folders.claim(str(run_dir))
    with pytest.raises(OSError):
        folders.held(str(run_dir))
    (run_dir / journal.JOURNAL).symlink_to(elsewhere)
    with pytest.raises(OSError):
        journal.Journal(str(run_dir), np.zeros(SHAPE, np.int64)).append(ACTIONS[0])
    hard = run_dir / checkpoints.METRICS
    hard.unlink()
    os.link(elsewhere, hard)  # a hard link: the same file under another name
    with pytest.raises(OSError):
        Logger(str(run_dir), None)
    assert elsewhere.read_bytes() == b"someone else's file\n"
    for name, fragment in (
        (folders.LOCK, "symbolic link"),
        (journal.JOURNAL, "symbolic link"),
        (checkpoints.METRICS, "hard link"),
    ):
        with pytest.raises(UsageError, match=fragment):
            folders.check_files(str(run_dir))
        (run_dir / name).unlink()
    folders.check_files(str(run_dir))
    (run_dir / "notes.txt").symlink_to(elsewhere)  # not a file the run reads or writes
    folders.check_files(str(run_dir))
    (run_dir / "videos").symlink_to(tmp_path)  # the final evaluation's, utils/evaluate.py's
    with pytest.raises(UsageError, match="videos is a symbolic link"):
        folders.check_files(str(run_dir))


# ---------------------------------------------------------------------------------------------
# One tiny real run, resumed with each damage
# ---------------------------------------------------------------------------------------------

SCRIPT = "appo_envpool.py"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A --deterministic APPO run of 2 tiny updates on CartPole-v1, with its journal."""
    run_dir = tmp_path_factory.mktemp("journal") / "run"
    assert run_main(SCRIPT, [*cli(SCRIPT, deterministic=True), "--run-dir", run_dir]) == 0
    assert (run_dir / journal.JOURNAL).stat().st_size > 0
    return run_dir


def files(folder):
    """{name: bytes} of the regular files in `folder`, and the names of its links."""
    return {
        name: None if (folder / name).is_symlink() else (folder / name).read_bytes()
        for name in os.listdir(folder)
    }


LINKED = [
    journal.JOURNAL,
    f"{CHECKPOINT}.tmp",
    folders.LOCK,
    checkpoints.METRICS,
    f"{checkpoints.CONFIG}.tmp",
]


def forge(run_dir, change):
    """The checkpoint of `run_dir` rewritten with `change(payload)` applied (a forged or damaged
    file)."""
    path = run_dir / CHECKPOINT
    payload = flax.serialization.msgpack_restore(path.read_bytes())
    change(payload)
    path.write_bytes(flax.serialization.msgpack_serialize(payload))


def illegal_without_carry(
    run_dir,
):  # a checkpoint as if from before carries, and actions no policy takes
    forge(run_dir, lambda payload: payload.pop("carry"))
    actions = np.fromfile(run_dir / journal.JOURNAL, np.int64)
    actions[5] = 7  # CartPole: Discrete(2)
    actions.tofile(run_dir / journal.JOURNAL)


FORGED = {  # how: (damage, the error line's fragment)
    "carry removed, an action of 7": (illegal_without_carry, "outside Discrete(2)"),
    "carry a string": (
        lambda d: forge(d, lambda p: p.update(carry="garbage")),
        "carries a 'carry'",
    ),
    "acting not parameters": (
        lambda d: forge(d, lambda p: p["carry"].update(acting={"1": {"x": np.zeros(3)}})),
        "carries a 'acting'",
    ),
    "journal size a string": (
        lambda d: forge(d, lambda p: p["carry"]["journal"].update(bytes="32768")),
        "carries a 'journal'",
    ),
    "global_step a string": (
        lambda d: forge(d, lambda p: p["state"].update(global_step="abc")),
        "global_step of 'abc', not a count",
    ),
    "policy_version negative": (
        lambda d: forge(d, lambda p: p["state"].update(policy_version=np.int64(-3))),
        "policy_version of -3, not a count",
    ),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "how",
    [
        "random bytes",
        "truncated",
        "missing",
        *(f"link {name}" for name in LINKED),
        *FORGED,
        "--num-envs 8 --num-steps 8",
    ],
)
def test_a_resume_from_a_damaged_folder_is_one_line_and_writes_nothing(
    tiny_run, tmp_path, capsys, how
):
    """The journal damaged, or a run file a link to a file elsewhere: --resume is refused in one
    line, exit 2, before anything is written (config.json, its files, the link's target: byte for
    byte as they were). With --no-deterministic a damaged journal is left alone and the run goes
    on."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    shutil.copytree(tiny_run, run_dir)
    elsewhere.write_bytes(b"someone else's file\n")
    flags, fragment = [], "symbolic link" if how.startswith("link ") else "--no-deterministic"
    if how.startswith("link "):
        path = run_dir / how[len("link ") :]
        if path.exists():
            path.unlink()
        path.symlink_to(elsewhere)
    elif how in FORGED:
        FORGED[how][0](run_dir)
        fragment = FORGED[how][1]
    elif how.startswith(
        "--"
    ):  # the same bytes an update as the run's 4 envs x 16 steps, in another shape
        flags, fragment = how.split(), "other --num-envs or --num-steps"
    else:
        damage(run_dir / journal.JOURNAL, how, elsewhere)
    before = files(run_dir)
    code, _, err = run_main(SCRIPT, ["--resume", run_dir, "--total-timesteps", 192, *flags], capsys)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("note: ")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment in lines[0], lines[0]
    assert files(run_dir) == before  # no resume recorded, no event file, the metrics not cut
    assert elsewhere.read_bytes() == b"someone else's file\n"
    if how == "random bytes":
        code, _, err = run_main(
            SCRIPT, ["--resume", run_dir, "--total-timesteps", 192, "--no-deterministic"], capsys
        )
        assert code == 0, err
        assert (
            int(checkpoints.read_checkpoint(str(run_dir / CHECKPOINT))["state"]["global_step"])
            == 192
        )
        assert (run_dir / journal.JOURNAL).read_bytes() == before[journal.JOURNAL]


@pytest.mark.timeout(300)
def test_a_resume_into_another_run_dir_takes_the_journal_with_it(tiny_run, tmp_path, capsys):
    """--resume A --run-dir B --deterministic: B's journal starts as a copy of A's, checked, and the
    run goes on as A resumed in place does (the same parameters, bit for bit); A is left as it
    was."""
    here, there = tmp_path / "here", tmp_path / "there"
    shutil.copytree(tiny_run, here)
    before = files(here)
    code, _, err = run_main(
        SCRIPT, ["--resume", here, "--run-dir", there, "--total-timesteps", 192], capsys
    )
    assert code == 0, err
    assert files(here) == before
    assert run_main(SCRIPT, ["--resume", here, "--total-timesteps", 192], capsys)[0] == 0
    assert (there / journal.JOURNAL).read_bytes() == (here / journal.JOURNAL).read_bytes()
    a, b = (checkpoints.read_checkpoint(str(d / CHECKPOINT)) for d in (here, there))
    assert all(
        np.array_equal(x, y)
        for x, y in zip(jax.tree.leaves(a["state"]), jax.tree.leaves(b["state"]))
    )
    assert a["carry"]["journal"] == b["carry"]["journal"]
