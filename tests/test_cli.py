import subprocess
import sys

from zerotron.cli import COMMANDS, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_unknown_command_suggests(capsys):
    assert main(["preprocss"]) == 2
    assert "did you mean preprocess" in capsys.readouterr().err


def test_python_dash_m_works():
    r = subprocess.run([sys.executable, "-m", "zerotron", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "preprocess" in r.stdout
