"""The command line is consistent: one name per idea, help with defaults for every option, every
option in the README, --debug and --version where a user types them.

Oracle: argparse's own table of each subcommand's options, read back, and the README's text.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ssdsl.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "examples" / "mlp.py")


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _options(p: argparse.ArgumentParser):
    for action in p._actions:
        if action.option_strings and not isinstance(action, (argparse._HelpAction,
                                                             argparse._VersionAction)):
            yield action


def test_every_option_has_help_and_shows_its_default():
    for name, p in _subcommands().items():
        for action in _options(p):
            flag = f"ssdsl {name} {action.option_strings[-1]}"
            assert action.help, f"{flag} has no help"
            has_default = action.default not in (None, False, [], argparse.SUPPRESS)
            if has_default and not isinstance(action, argparse._StoreTrueAction):
                assert "default" in action.help, f"{flag}: help does not say its default"


def test_readme_lists_every_option():
    readme = (ROOT / "README.md").read_text()
    missing = [f"{name} {opt}" for name, p in _subcommands().items() for action in _options(p)
               for opt in action.option_strings[-1:] if opt not in readme
               and opt not in ("--debug",)]
    assert not missing, f"README.md does not mention: {', '.join(missing)}"
    assert "--debug" in readme and "--version" in readme


def test_device_count_is_world_everywhere():
    for name, p in _subcommands().items():
        flags = {o for a in _options(p) for o in a.option_strings}
        assert "--nproc" not in flags or "--world" in flags, name
        if "--nproc" in flags:  # kept as an alias of --world
            act = next(a for a in _options(p) if "--nproc" in a.option_strings)
            assert "--world" in act.option_strings


def test_debug_after_the_subcommand_and_version(capsys):
    args = build_parser().parse_args(["check", "dp", "--debug"])
    assert args.debug is True
    assert build_parser().parse_args(["--debug", "check", "dp"]).debug is True
    assert build_parser().parse_args(["check", "dp"]).debug is False
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("ssdsl ")


def test_run_world_and_set_world_must_agree(capsys):
    assert main(["run", MLP, "dp", "--nproc", "2", "--set", "world=4"]) == 2
    err = capsys.readouterr().err
    assert "--set world=4 disagrees with the 2 ranks" in err and "--world 4" in err
    assert "Traceback" not in err


def test_the_script_flushes_and_exits_with_mains_status(monkeypatch):
    """``run_main`` ends with ``os._exit`` (no slow teardown): what was printed is flushed first
    and the status is main's. Oracle: a stream that records flushes, and the status main
    returned, passed through unchanged."""
    import io
    import os
    import sys

    import ssdsl.cli as cli

    class Recording(io.StringIO):
        flushed = ""

        def flush(self):
            self.flushed = self.getvalue()

    out, err = Recording(), Recording()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)

    def fake_main():
        print("a line still in the buffer")
        print("an error", file=sys.stderr)
        return 2

    exits = []
    monkeypatch.setattr(cli, "main", fake_main)
    monkeypatch.setattr(os, "_exit", exits.append)
    cli.run_main()
    assert exits == [2]
    assert out.flushed == "a line still in the buffer\n" and err.flushed == "an error\n"


def test_cost_devices_are_the_profiles():
    from ssdsl.cli.cost import DEVICES
    from ssdsl.cost.profiles import profile_names
    assert sorted(DEVICES) == sorted(profile_names())


@pytest.mark.slow
def test_help_and_bad_flags_answer_without_loading_torch():
    """Building the parser imports no torch, so `ssdsl --help`, `--version` and a mistyped flag
    answer at once. Oracle: sys.modules of a fresh interpreter."""
    import subprocess
    import sys
    code = ("import sys\nfrom ssdsl.cli import build_parser, main\nbuild_parser()\n"
            "print('torch' in sys.modules)\n"
            "try:\n    main(['run', 'm.py', 'dp', '--stepz', '3'])\n"
            "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.stdout.split() == ["False", "2", "False"], out.stdout + out.stderr
    assert "unrecognized arguments: --stepz" in out.stderr


@pytest.mark.parametrize("flags, says", [
    (["--timeout", "0"], "--timeout must be above 0 seconds, not 0"),
    (["--timeout", "-5"], "--timeout must be above 0 seconds, not -5"),
    (["--lr", "-1", "--optimizer", "sgd"], "--lr must be at least 0, not -1"),
])
def test_run_refuses_numbers_that_cannot_work_before_starting(flags, says, capsys):
    """Were: a job stopped at once for "running past its time limit of 0 s", and every rank
    failing in torch.optim with a raw ValueError."""
    assert main(["run", MLP, "dp", "--no-verify", *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and "starting" not in err


@pytest.mark.parametrize("command", [["trace", MLP], ["cost", MLP, "dp"]])
def test_a_batch_size_below_one_is_a_usage_error(command, capsys):
    """Was a ZeroDivisionError traceback in `trace --batch-size 0`."""
    with pytest.raises(SystemExit) as exc:
        main([*command, "--batch-size", "0"])
    assert exc.value.code == 2
    assert "argument --batch-size: must be at least 1, not 0" in capsys.readouterr().err


def test_the_torchrun_rule_is_the_launchers():
    from ssdsl.cli.run import torchrun_rank
    from ssdsl.runtime.launch import under_torchrun
    envs = [{}, {"RANK": "3"}, {"RANK": "3", "WORLD_SIZE": "4"},
            {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"},
            {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "OTHER": "x"}]
    for env in envs:
        assert (torchrun_rank(env) is not None) == under_torchrun(env), env
    assert torchrun_rank(envs[3]) == 3


@pytest.mark.slow
def test_run_shows_its_first_line_before_torch_is_imported():
    """Oracle: sys.modules at the moment the first line is written, in a fresh interpreter."""
    import subprocess
    import sys
    code = ("import sys\n"
            "class Out:\n"
            "    seen = []\n"
            "    def write(self, text):\n"
            "        self.seen.append((text, 'torch' in sys.modules)); return len(text)\n"
            "    def flush(self): pass\n"
            "    def isatty(self): return False\n"
            "out = Out(); sys.stdout = out\n"
            "from ssdsl.cli import main\n"
            "code = main(['run', 'no_such_model.py', 'dp'])\n"
            "sys.stdout = sys.__stdout__\n"
            "print(code, out.seen[0][1], 'planning' in out.seen[0][0])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.stdout.split() == ["2", "False", "True"], out.stdout + out.stderr
    assert "model file not found: no_such_model.py" in out.stderr


def test_debug_drops_the_advice_to_run_with_debug(tmp_path, monkeypatch, capsys) -> None:
    """Under --debug the error is raised with its traceback: its hint no longer tells the user
    to run with --debug (the rest of the hint stays); without --debug it does."""
    import pytest

    from ssdsl.cli import main
    from ssdsl.errors import SsdslError
    from ssdsl.trace import model_file

    def failing(path, *a, **k):
        raise SsdslError("torch.export failed", file=str(path),
                         hint="run with --debug for the full traceback; data-dependent control "
                         "flow is a common cause")

    monkeypatch.setattr(model_file, "load_model_file", failing)
    model = tmp_path / "m.py"
    model.write_text("")
    assert main(["trace", str(model)]) == 2
    assert "run with --debug for the full traceback" in capsys.readouterr().err
    with pytest.raises(SsdslError) as caught:
        main(["--debug", "trace", str(model)])
    assert "--debug" not in str(caught.value)
    assert caught.value.hint == "data-dependent control flow is a common cause"
