"""Grain's ReadOptions as the benchmarks give them, in one place: bench.py and sft_bench.py
both read Grain with these, and sft_bench.py cannot import bench.py (bench.py imports it)."""

from __future__ import annotations

# (num_threads, prefetch_buffer_size): none, small, medium, Grain's default (16, 500)
GRAIN_READ_OPTIONS = ((0, 0), (1, 16), (2, 64), (16, 500))
# mp_prefetch workers read with this: each worker is a process, its own threads add little.
# The packed-SFT rows' packers read with it too: the best of GRAIN_READ_OPTIONS for them
# (best-fit by hand, 15-batch medians, two runs on the loaded shared cores: (1, 16) 0.40 /
# 1.76 M target slots/s, (0, 0) 0.27 / 1.85 M, Grain's default (16, 500) 0.14 / 0.56 M)
GRAIN_MP_READ = (1, 16)
