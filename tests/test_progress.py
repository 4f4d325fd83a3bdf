"""Progress output: a live bar on a terminal, and one summary line when stderr is a log or pipe."""

from __future__ import annotations

import fcntl
import json
import os
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from pipeline import progress

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = 3000


def test_prepare_writes_one_summary_line_and_no_redraws_into_a_log(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(DOCUMENTS))
    )
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "prepare", str(corpus), "--out", str(tmp_path / "s")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr  # not one redraw, let alone one per document
    lines = [line for line in done.stderr.splitlines() if line.startswith("prepare")]
    assert len(lines) == 1, done.stderr
    assert f"{DOCUMENTS} doc" in lines[0] and "tok/s" in lines[0], lines[0]


def test_a_bar_on_a_terminal_redraws_live(monkeypatch):
    main, secondary = os.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    with os.fdopen(secondary, "w") as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        for _ in progress.progress_bar(range(5), desc="work", unit=" item"):
            pass
    drawn = b""
    while True:  # the terminal hands its output over in pieces; EIO once it is all read
        try:
            piece = os.read(main, 1 << 16)
        except OSError:
            break
        if not piece:
            break
        drawn += piece
    os.close(main)
    drawn = drawn.decode()
    assert "\r" in drawn and "work" in drawn and "5/5" in drawn


@pytest.mark.parametrize("enabled", [True, False])
def test_off_a_terminal_a_bar_is_one_line_or_nothing(capsys, enabled):
    bar = progress.progress_bar(desc="verify", unit=" step", total=40, enabled=enabled)
    for _ in range(40):
        bar.update(1)
    bar.close()
    bar.close()  # a second close writes nothing more
    err = capsys.readouterr().err
    if enabled:
        assert err.count("\n") == 1 and "\r" not in err and "40/40" in err, err
    else:
        assert err == ""


def test_off_a_terminal_a_bar_ended_by_an_error_writes_nothing(capsys):
    """The error is the one line a failed command prints: no count of the work cut short."""
    with pytest.raises(ValueError):
        for _ in progress.progress_bar(range(5), desc="verify", unit=" step"):
            raise ValueError
    bar = progress.progress_bar(desc="prepare", unit=" doc")
    with pytest.raises(ValueError):
        try:
            bar.update(1)
            raise ValueError
        finally:
            bar.close()
    assert capsys.readouterr().err == ""


def test_off_a_terminal_a_bar_run_inside_an_error_handler_still_writes_its_line(capsys):
    """An error handled around the whole bar (a store found missing, then prepared) is not the
    bar's: a bar that ends without an error of its own writes its line."""
    try:
        raise KeyError("no store yet")
    except KeyError:
        for _ in progress.progress_bar(range(5), desc="prepare", unit=" doc"):
            pass
        bar = progress.progress_bar(desc="verify", unit=" step", total=2)
        bar.update(2)
        bar.close()
        with pytest.raises(ValueError):  # an error of its own still ends it silently
            for _ in progress.progress_bar(range(5), desc="verify", unit=" step"):
                raise ValueError from None
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "5/5" in err and "2/2" in err, err
