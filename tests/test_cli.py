"""The command line itself. Bad input, for every command, is tests/test_bad_input.py."""

from lorabench.cli import main


def test_help_works(capsys):
    assert main(["sweep", "--help"]) == 0
    assert "--max-loras" in capsys.readouterr().out
