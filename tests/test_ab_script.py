"""scripts/ab.sh: an earlier commit's code packed, a command run with it swapped into the tree and
then with the tree's own, the tree restored whatever the command does."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "ab.sh"
SHOW = ["sh", "-c", 'cat lorabench/which kernels/which; echo "sha=$LORABENCH_GIT_SHA" "$@"', "sh"]


def fake_tree(tmp_path: Path) -> Path:
    """A tree with the script, its own lorabench/ and kernels/, and a packed baseline X."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, tree / "scripts" / "ab.sh")
    for root, label in ((tree, "new"), (tree / ".ab" / "X", "base")):
        for package in ("lorabench", "kernels"):
            (root / package).mkdir(parents=True)
            (root / package / "which").write_text(f"{package} {label}\n")
    (tree / ".ab" / "X" / "SHA").write_text("abc123\n")
    return tree


def ab(tree: Path, *args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([str(tree / "scripts" / "ab.sh"), *args], capture_output=True, text=True, env=env,
                          timeout=60)


def test_the_command_runs_on_the_baseline_then_on_the_tree_which_is_restored(tmp_path):
    tree = fake_tree(tmp_path)
    done = ab(tree, "run", "X", "OUT", "--", *SHOW)
    assert done.returncode == 0, done.stderr
    base, new = done.stdout.split("== new: this tree")
    assert "lorabench base" in base and "kernels base" in base and "sha=abc123 --out OUT/base" in base
    assert "lorabench new" in new and "kernels new" in new and "--out OUT/new" in new and "abc123" not in new
    assert (tree / "lorabench" / "which").read_text() == "lorabench new\n"
    assert (tree / "kernels" / "which").read_text() == "kernels new\n"


def test_a_failing_command_leaves_the_tree_as_it_was_and_exits_non_zero(tmp_path):
    tree = fake_tree(tmp_path)
    done = ab(tree, "run", "X", "OUT", "--", "sh", "-c", "exit 3", "sh")
    assert done.returncode == 2 and "base exited 3, new 3" in done.stderr
    assert (tree / "lorabench" / "which").read_text() == "lorabench new\n"


def test_the_tree_is_back_before_the_second_run_when_only_the_first_fails(tmp_path):
    """The baseline's run fails; the tree's own code still runs second, and the status says which failed."""
    tree = fake_tree(tmp_path)
    cmd = 'grep -q base lorabench/which && exit 4; cat lorabench/which'
    done = ab(tree, "run", "X", "OUT", "--", "sh", "-c", cmd, "sh")
    assert done.returncode == 2 and "base exited 4, new 0" in done.stderr
    assert "lorabench new" in done.stdout.split("== new: this tree")[1]


def test_what_the_second_run_writes_into_the_tree_stays(tmp_path):
    tree = fake_tree(tmp_path)
    done = ab(tree, "run", "X", "OUT", "--", "sh", "-c", "echo made > kernels/made", "sh")
    assert done.returncode == 0, done.stderr
    assert (tree / "kernels" / "made").read_text() == "made\n"
    assert not (tree / ".ab" / "X" / "kernels" / "made").exists()


def test_a_used_out_folder_is_refused(tmp_path):
    """Runs from an earlier call in OUT would be compared, or stop the compare: a new OUT is asked for."""
    tree = fake_tree(tmp_path)
    (tree / "OUT" / "base" / "old-run").mkdir(parents=True)
    done = ab(tree, "run", "X", "OUT", "--", *SHOW)
    assert done.returncode == 2 and "OUT/base is not empty" in done.stderr and done.stdout == ""


@pytest.mark.parametrize("args, says", [(["run", "Y", "OUT", "--", "true"], "is not packed"),
                                        (["pack", "no-such-commit"], "no commit"),
                                        (["run", "X", "OUT", "true"], "usage"), (["nothing"], "usage")])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, says):
    tree = fake_tree(tmp_path)
    done = ab(tree, *args)
    assert done.returncode == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert (tree / "lorabench" / "which").read_text() == "lorabench new\n"


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs this repository's git")
def test_pack_writes_the_commits_code_and_sha(tmp_path):
    import os
    done = subprocess.run([str(SCRIPT), "pack", "HEAD"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "AB_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert (tmp_path / "HEAD" / "SHA").read_text().strip() == head
    assert (tmp_path / "HEAD" / "lorabench" / "__init__.py").is_file()
    assert (tmp_path / "HEAD" / "kernels" / "gemm_lora.py").is_file()
