"""The JAX layer: plans become global `jax.Array`s, and the data state an Orbax checkpoint item.

`data_feed` reads host rows ahead of the step (in `readers`' threads) and assembles them into
arrays sharded over the user's mesh (`geometry`); `eval_feed` does the same for held-out stores;
`checkpoint` saves and restores the data state next to the model, through `restore` (shared
with `pipeline.maxtext`, no Orbax);
`store_check` runs the stores' full verification policy; `grain_source` offers host rows as a
Grain `MapDataset`; `stats` keeps the feed's figures (rows per source, read and wait times,
input-bound steps) and `metrics` serves them to Prometheus.
"""
