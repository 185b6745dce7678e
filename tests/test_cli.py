"""The ``mlx-infer`` entry point: whatever happens, one line or none and an exit code, not a traceback."""

from __future__ import annotations

import pytest

from mlx_infer import cli
from mlx_infer.errors import Terminated


def test_ctrl_c_while_the_subcommands_import_is_exit_130(monkeypatch, capsys):
    # Building the parser imports every subcommand's module (MLX among them): a Ctrl-C typed in those
    # seconds is an interrupt like any other, not a KeyboardInterrupt traceback.
    def interrupted(name: str):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    assert cli.main(["plan", "-m", "x"]) == 130
    assert capsys.readouterr().err == ""


def test_sigterm_before_the_command_runs_is_serves_normal_stop(monkeypatch, capsys):
    # A supervisor stopping a server that has not started yet stops it as it would a running one (0);
    # any other command ends 143, as SIGTERM's.
    def terminated(name: str):
        raise Terminated

    monkeypatch.setattr(cli.importlib, "import_module", terminated)
    assert cli.main(["serve", "-m", "x"]) == 0
    assert cli.main(["generate", "-m", "x"]) == 143
    assert capsys.readouterr().err == ""


def test_an_unknown_flag_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["plan", "-m", "x", "--no-such-flag"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments: --no-such-flag" in err
