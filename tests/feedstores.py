"""Small synthetic stores and data configs for the feed, checkpoint and multi-host tests.

`two_stage_config` is sized so that within ~30 steps both sources roll over epochs and the
run moves from stage `warmup` (steps 0..9) to stage `main`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import DataConfig, parse_config
from tests.storegen import write_synthetic_store

SHARDS = {
    "code": [[7, 30, 11, 19], [25, 5, 40], [13, 13, 13, 60]],
    "docs": [[50, 3, 22], [9, 9, 31, 45, 12]],
}


def write_stores(directory: Path, flat: bool = True) -> dict[str, Path]:
    paths = {}
    for name, shards in SHARDS.items():
        paths[name] = Path(directory) / name
        if not paths[name].exists():
            write_synthetic_store(paths[name], shards, flat=flat)
    return paths


def two_stage_raw(directory: Path, *, flat: bool = True, **overrides: Any) -> dict[str, Any]:
    """The config's mapping; `flat=False` writes the stores without flat token sidecars."""
    paths = write_stores(directory, flat)
    raw = {
        "seed": 7,
        "seq_len": 8,
        "global_batch_size": 8,
        "lanes": 2,
        "sources": {name: {"path": str(path)} for name, path in paths.items()},
        "stages": [
            {"name": "warmup", "steps": 10, "mix": {"code": 1, "docs": 1}},
            {"name": "main", "mix": {"code": 3, "docs": 1}},
        ],
    }
    raw.update(overrides)
    return raw


def two_stage_config(directory: Path, *, flat: bool = True, **overrides: Any) -> DataConfig:
    return parse_config(two_stage_raw(directory, flat=flat, **overrides), origin="feed-test.yaml")


def excluding_raw(directory: Path) -> dict[str, Any]:
    """`geometry_raw` at seq_len 32 on 1 lane, taking down three documents of each source
    (docs/steering.md, "Take documents down"): the take-down file is written beside the stores."""
    raw = geometry_raw(directory)
    for name in raw["sources"]:
        file = Path(directory) / f"takedown-{name}.txt"
        file.write_text("s0-d3\ns1-d7\ns2-d1\n" if name == "web" else "s0-d2\ns1-d5\ns1-d9\n")
        raw["sources"][name]["exclude"] = str(file)
    return raw


def geometry_raw(directory: Path, seq_len: int = 32, lanes: int = 1) -> dict[str, Any]:
    """A run of random text (every token a distinct random id, so every 24-gram is unique) in
    two sources, `web` (concat) and `chat` (best_fit, documents of up to 60 tokens), that a
    switch moves from seq_len 32 on 1 lane to 64 on 2 (docs/steering.md, context extension)."""
    rng = np.random.default_rng(5)
    shards = {
        "web": [rng.integers(5, 120, 30).tolist() for _ in range(3)],
        "chat": [rng.integers(3, 60, 40).tolist() for _ in range(2)],
    }
    for seed, (name, lengths) in enumerate(shards.items(), start=1):
        if not (Path(directory) / name).exists():
            write_synthetic_store(Path(directory) / name, lengths, shuffled=seed, document_ids=True)
    return {
        "seed": 5,
        "seq_len": seq_len,
        "global_batch_size": 4,
        "lanes": lanes,
        "sources": {
            "web": {"path": str(Path(directory) / "web")},
            "chat": {"path": str(Path(directory) / "chat"), "packing": "best_fit"},
        },
        "stages": [{"name": "all", "mix": {"web": 1, "chat": 1}}],
    }
