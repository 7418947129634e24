"""jax_async_rl.folders: one owner per run folder (the lock), the checks before a run takes a
folder, config.json as the run's record, and the metrics cut on resume."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from jax_async_rl import folders
from jax_async_rl.flags import UsageError

HOLD = textwrap.dedent("""
    import sys, time
    from jax_async_rl import folders
    lock = folders.claim(sys.argv[1])
    print("held", flush=True)
    time.sleep(600)
""")


def args_for(run_dir=None, resume=None):
    return SimpleNamespace(
        run_dir=run_dir, resume=resume, env_id="CartPole-v1", exp_name="x", seed=1
    )


def test_a_folder_has_one_owner_and_a_dead_owner_does_not_block(tmp_path):
    """A second claim while the first is held is refused with the holder's pid and host; once
    the holder is SIGKILLed (no clean-up ran), the folder can be claimed again."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UsageError, match=rf"in use by another run \(pid {holder.pid} on "):
            folders.claim(str(tmp_path))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = folders.claim(str(tmp_path))
    assert (tmp_path / folders.LOCK).read_text().startswith(f"pid {os.getpid()} on ")
    with pytest.raises(
        UsageError, match=f"pid {os.getpid()}"
    ):  # one lock a run: a second claim in-process too
        folders.claim(str(tmp_path))
    lock.close()
    folders.claim(str(tmp_path)).close()


def test_a_run_folders_name_holds_no_character_awkward_in_a_path(tmp_path, monkeypatch):
    """A user's env id `module:callable` gave runs/myenvs:LineWorld__...; an --exp-name with a
    slash made a nested folder. Each run of such characters becomes `-`."""
    monkeypatch.chdir(tmp_path)
    args = SimpleNamespace(
        run_dir=None, resume=None, env_id="myenvs:LineWorld", exp_name="my/exp 'a'", seed=1
    )
    folder, created, lock = folders.make(args, resumed=False)
    lock.close()
    name = os.path.basename(folder)
    assert os.path.dirname(folder) == "runs" and name.startswith(
        "myenvs-LineWorld__my-exp-a-__1__"
    ), folder


def test_make_refuses_a_folder_taken_after_the_start_up_checks(tmp_path):
    """Run A and run B both passed the start-up check of an empty --run-dir; A then claimed it and
    wrote its config. B, claiming after A ended, is refused: the folder now holds a run."""
    run_dir = str(tmp_path / "same_dir")
    folders.check(args_for(run_dir), resumed=False)  # both runs pass this before either writes
    made, created, lock = folders.make(args_for(run_dir), resumed=False)
    assert (made, created) == (run_dir, True)
    with pytest.raises(UsageError, match="in use by another run"):
        folders.make(args_for(run_dir), resumed=False)
    (tmp_path / "same_dir" / "config.json").write_text("{}")
    lock.close()
    with pytest.raises(UsageError, match="holds a run that saved no checkpoint"):
        folders.make(args_for(run_dir), resumed=False)


def test_check_names_what_a_killed_first_save_left(tmp_path, host_run):
    """Killed while writing its first checkpoint, a run leaves config.json and
    checkpoint.msgpack.tmp: a complete one makes the folder a run to resume, a partial one is
    named in the refusal."""
    (tmp_path / "config.json").write_text("{}")
    data = (host_run / "checkpoint.msgpack").read_bytes()
    tmp = tmp_path / "checkpoint.msgpack.tmp"
    tmp.write_bytes(data[: len(data) // 3])
    with pytest.raises(
        UsageError, match=r"saved no checkpoint \(only an incomplete checkpoint.msgpack.tmp\)"
    ):
        folders.check(args_for(str(tmp_path)), resumed=False)
    tmp.write_bytes(data)
    with pytest.raises(
        UsageError, match=f"already holds a run; continue it with --resume {tmp_path}"
    ):
        folders.check(args_for(str(tmp_path)), resumed=False)


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("[1, 2, 3]", "holds a list, not a run's record"),
        ("", "not readable JSON"),
        ("{garbage", "not readable JSON"),
        (b"\xff\xfe\x00", "not readable JSON"),
        (None, "is missing"),
        pytest.param("[" * 100_000, r"not readable JSON \(RecursionError\)", id="nested-too-deep"),
        ('{"resumes": 5}', '"resumes" is 5, not a list'),  # a TypeError where a resume is appended
        ('{"resumes": "ab"}', '"resumes" is "ab", not a list'),  # spread into ["a", "b", {...}]
        ('{"resumes": [{"step": 1}, 3]}', r'"resumes"\[1\] is 3, not a resume.s record'),
    ],
)
def test_a_damaged_record_is_an_error_and_never_rewritten(tmp_path, content, fragment):
    """Resuming into a folder whose config.json is a list, empty, garbage, nested too deep for the
    parser, missing, or whose "resumes" is no list of objects (a TypeError traceback where the
    resume's entry was appended): UsageError naming the file (and the key), and the file is left
    as it was."""
    path = tmp_path / "config.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(UsageError, match=fragment) as error:
        folders.write_config(
            str(tmp_path), make_args(args_for(resume=str(tmp_path))), {}, 100, "8 envs"
        )
    assert str(path) in str(error.value)
    with pytest.raises(
        UsageError, match=fragment
    ):  # already at start-up, where every process agrees to stop
        folders.check(make_args(args_for(resume=str(tmp_path))), resumed=True)
    expected = content.encode() if isinstance(content, str) else content
    assert (path.read_bytes() if path.exists() else None) == expected


def make_args(namespace):
    """A dataclass instance (write_config reads it with dataclasses.asdict)."""
    cls = dataclasses.make_dataclass("Args", list(vars(namespace)))
    return cls(**vars(namespace))


def test_each_resume_appends_to_the_record(tmp_path):
    """The first run's record survives every resume; each resume adds its own entry."""
    folders.write_config(str(tmp_path), make_args(args_for(run_dir=str(tmp_path))), {}, 0, "8 envs")
    first = json.loads((tmp_path / "config.json").read_text())
    for step in (100, 200):
        folders.write_config(
            str(tmp_path), make_args(args_for(resume=str(tmp_path))), {"seed": 2}, step, "16 envs"
        )
    record = json.loads((tmp_path / "config.json").read_text())
    assert {k: record[k] for k in first} == first
    assert [r["step"] for r in record["resumes"]] == [100, 200] and record["resumes"][0][
        "changed"
    ] == {"seed": 2}


def test_the_metrics_are_cut_back_to_the_checkpoint(tmp_path):
    """Records past the checkpoint's step go, and a line cut off by a crash, and a line that is no
    record with a finite step (a step of Infinity was an OverflowError, a deeply nested line a
    RecursionError, after config.json had its resume); the rest stay as they were."""
    lines = [
        json.dumps({"step": s, "wall_time": 1.0, "tag": "t", "value": 0.0})
        for s in (0, 10, 20, 30, 40)
    ]
    damaged = [lines[1].replace('"step": 10', '"step": Infinity'), "[" * 100_000, '{"step": NaN}']
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(lines[:2] + damaged + lines[2:]) + '\n{"step": 5'
    )
    assert folders.cut_metrics(str(tmp_path), 20) == 6
    assert (tmp_path / "metrics.jsonl").read_text() == "\n".join(lines[:3]) + "\n"
    assert folders.cut_metrics(str(tmp_path), 20) == 0
    assert folders.cut_metrics(str(tmp_path / "none"), 20) == 0


@pytest.mark.parametrize("name", ["metrics.jsonl", "actions.bin"])
@pytest.mark.parametrize("link", ["hard", "symbolic"])
def test_a_linked_file_the_run_keeps_is_refused_with_advice_that_keeps_it(tmp_path, name, link):
    """A hard-linked actions.bin was refused with "remove it", which lost the journal (and with it
    a --deterministic resume): the advice is one line, a command that replaces the file with a copy
    of itself, and following it leaves the content, the other name untouched, and the check
    passing."""
    run_dir, elsewhere = tmp_path / "run dir", tmp_path / "elsewhere"
    run_dir.mkdir()
    elsewhere.write_bytes(b"the run's records\n")
    os.link(elsewhere, run_dir / name) if link == "hard" else (run_dir / name).symlink_to(elsewhere)
    with pytest.raises(UsageError, match="replace it with a copy of itself") as error:
        folders.check_files(str(run_dir))
    message = str(error.value)
    assert "\n" not in message and "remove it" not in message, message
    command = message[message.index("(cp ") + 1 : -1]
    subprocess.run(["sh", "-c", command], check=True)
    folders.check_files(str(run_dir))
    assert (run_dir / name).read_bytes() == elsewhere.read_bytes() == b"the run's records\n"
    assert not (run_dir / name).is_symlink() and os.stat(run_dir / name).st_nlink == 1
