"""scripts/heartbeat.py: the line the watchdogs read (tpu/recover.sh, the GKE liveness probe)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("heartbeat", ROOT / "scripts" / "heartbeat.py")
heartbeat = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(heartbeat)


class Feed:
    def __init__(self):
        self.asked = 0

    def stats(self):
        self.asked += 1
        return type("Stats", (), {"slowest_process": 3})()


def words(path: Path) -> dict[str, str]:
    return dict(word.split("=", 1) for word in path.read_text().split())


def test_the_first_step_is_written_then_at_most_every_interval(tmp_path, monkeypatch):
    clock = iter([100.0, 101.0, 111.0])
    monkeypatch.setattr(heartbeat.time, "time", lambda: next(clock))
    path = tmp_path / "beat"
    beat, feed = heartbeat.Heartbeat(path, save_every=50, every_s=10), Feed()
    beat.beat(1, 0, feed)
    assert words(path)["step"] == "1" and words(path)["time"] == "100"
    beat.beat(2, 0, feed)  # a second later: not written, the feed not asked
    assert words(path)["step"] == "1" and feed.asked == 1
    beat.beat(12, 0, feed)  # 11 steps in 11 s: a save every 50 steps is 50 s
    assert words(path) == {"step": "12", "time": "111", "host": beat.host, "process": "0",
                           "save_seconds": "50", "slowest_process": "3"}  # fmt: skip
    assert not path.with_name("beat.tmp").exists()


def test_no_file_no_heartbeat_and_a_failed_write_is_not_an_error(tmp_path):
    heartbeat.Heartbeat(None, save_every=10).beat(1, 0)
    heartbeat.Heartbeat(tmp_path / "gone" / "beat", save_every=10).beat(1, 0)  # no directory
    assert list(tmp_path.iterdir()) == []
