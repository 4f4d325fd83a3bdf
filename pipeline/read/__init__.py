"""The read layer: a plan's rows as the six batch fields, between the pure plan and the feed.

`plan.Plan` (the package's `pipeline.Plan`) is the plan of the draws (`pipeline.plan`) with the
one reader of a step's rows, over the plan's one set of open stores (`pipeline.store.store_set`);
`windows` reads the rows of windowed sources (concat), `documents` those of whole-document
sources (best_fit), `batch` builds the six fields of windows and holds the one loss-mask path.
`audit` verifies a range of steps by reading them (`pipeline verify`); `eval_plan` plans a
held-out store. Nothing here imports JAX, Orbax or Grain.
"""
