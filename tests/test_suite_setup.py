"""The suite's own set-up (tests/conftest.py): the learning runs share one pytest-xdist worker."""

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CONFTEST = f"""
import importlib.util, sys
sys.path.insert(0, {str(TESTS)!r})
spec = importlib.util.spec_from_file_location("suite_conftest", {str(TESTS / "conftest.py")!r})
suite_conftest = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite_conftest)
pytest_collection_modifyitems = suite_conftest.pytest_collection_modifyitems
"""

TESTS_TEXT = """
import os, pathlib, time, pytest

def record(name):
    time.sleep(0.3)
    worker = os.environ["PYTEST_XDIST_WORKER"]
    pathlib.Path(__file__).with_name(name).write_text(worker)

@pytest.mark.slow
@pytest.mark.parametrize("i", range(4))
def test_learning(i):
    record(f"learning{i}")

@pytest.mark.parametrize("i", range(4))
def test_other(i):
    record(f"other{i}")
"""


def test_the_learning_runs_share_one_worker(tmp_path):
    """Under the suite's options (-n 2 --dist loadgroup), the `slow` tests run on one worker, one
    after the other, and the others on both: pytest-xdist groups by a marker it reads in its own
    collection hook, so the suite's hook must add the marker before it (tryfirst)."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_grouped.py").write_text(TESTS_TEXT)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: learning runs\n")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup"]
        + ["-p", "no:cacheprovider", "-p", "no:randomly", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    learning = {(tmp_path / f"learning{i}").read_text() for i in range(4)}
    others = {(tmp_path / f"other{i}").read_text() for i in range(4)}
    assert len(learning) == 1, learning
    assert others - learning, (learning, others)  # the other worker took the rest
