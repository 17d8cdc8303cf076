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


def test_without_output_a_fresh_name_is_chosen(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "one_f_one_b.svg").write_text("a file of mine")
    assert main(["show", "1f1b", "--world", "2"]) == 0
    assert (tmp_path / "one_f_one_b.svg").read_text() == "a file of mine"
    assert (tmp_path / "one_f_one_b-2.svg").read_text().startswith("<svg")
    assert "wrote one_f_one_b-2.svg" in capsys.readouterr().out


def test_without_world_it_says_what_it_assumed(capsys):
    assert main(["show", "1f1b", "--no-picture"]) == 0
    assert "world = 1 (assumed" in capsys.readouterr().out
    assert main(["show", "1f1b", "--world", "2", "--no-picture"]) == 0
    assert "assumed" not in capsys.readouterr().out


def test_png_without_rsvg_convert_names_it(tmp_path, capsys, monkeypatch):
    import shutil
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert main(["show", "1f1b", "--world", "2", "-o", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert "rsvg-convert" in err and "librsvg" in err


def test_device_ranges_are_half_open_everywhere():
    from ssdsl.cli._resolve import devices_text
    from ssdsl.schedule.picture import ranges_text
    assert devices_text([0, 1, 2, 3]) == ranges_text([0, 1, 2, 3]) == "0..4"
    assert devices_text([0, 2, 5]) == "0,2,5" and devices_text([]) == "-"


def test_a_picture_name_it_cannot_write_is_refused_before_the_work(tmp_path, capsys):
    out = tmp_path / "s.txt"
    assert main(["show", "1f1b", "--world", "2", "-o", str(out)]) == 2
    captured = capsys.readouterr()
    assert "must end in .svg or .png" in captured.err
    assert captured.out == "" and not out.exists()  # no timeline printed, nothing written
