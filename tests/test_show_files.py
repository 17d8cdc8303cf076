"""`ssdsl show` never overwrites a file it did not write."""

from ssdsl.cli import main


def test_show_replaces_its_own_picture_but_not_a_users_file(tmp_path, capsys):
    ours = tmp_path / "s.svg"
    assert main(["show", "1f1b", "--world", "4", "-o", str(ours)]) == 0
    assert main(["show", "gpipe", "--world", "4", "-o", str(ours)]) == 0  # its own: replaced
    theirs = tmp_path / "mine.svg"
    theirs.write_text("<svg>a drawing of mine</svg>")
    capsys.readouterr()
    assert main(["show", "1f1b", "--world", "4", "-o", str(theirs)]) == 2
    assert "not written by ssdsl show" in capsys.readouterr().err
    assert theirs.read_text() == "<svg>a drawing of mine</svg>"
