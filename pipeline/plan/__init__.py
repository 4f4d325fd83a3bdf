"""The plan layer: which rows of which stores every step holds, as a pure function.

`(ledger, step, rows) -> draws` (`plan.DrawPlan.draws`): `layout` cuts a source into epochs,
lanes and windows from its store's metadata alone, `packing` packs a best-fit source's
documents into rows (kept on disk by `packing_cache`), both row layouts declared by
`row_layout` (the interface and its registry); `sources` opens a config's stores, or loads only
their metadata; `mixing` and `stages` decide which source each lane position draws (`clock`
under a batch-size schedule); `ledger` records the run's config segments; `resume` reconciles a
restored ledger with the config; `data_state` reads, writes and verifies the checkpointed
`{step, ledger, digest}`; `report` answers questions about a plan (stages, epochs). A store's
files are reached only through the opener a plan is given (`pipeline.store.store_set`);
reading rows is the read layer's (`pipeline.read`). Nothing here imports JAX, Orbax or Grain.
"""
