"""The ``mlx-infer`` entry point: whatever happens, one line or none and an exit code, not a traceback."""

from __future__ import annotations

import pytest

from mlx_infer import cli


def test_ctrl_c_while_the_subcommands_import_is_exit_130(monkeypatch, capsys):
    # Building the parser imports every subcommand's module (MLX among them): a Ctrl-C typed in those
    # seconds is an interrupt like any other, not a KeyboardInterrupt traceback.
    def interrupted(name: str):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    assert cli.main(["plan", "-m", "x"]) == 130
    assert capsys.readouterr().err == ""


def test_an_unknown_flag_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["plan", "-m", "x", "--no-such-flag"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments: --no-such-flag" in err
