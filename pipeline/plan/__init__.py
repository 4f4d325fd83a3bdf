"""The plan layer: which tokens every row of every step holds, as a pure function.

`layout` cuts a source into epochs, lanes and windows from its store's metadata alone
(`sources` opens a config's stores, or loads only their metadata); `mixing` and `stages` decide
which source each lane position draws; `ledger` records the run's config segments; `plan`
combines them into `(ledger, step, row) -> batch fields` (`batch`); `resume` reconciles a
restored ledger with the config; `data_state` reads, writes and verifies the checkpointed
`{step, ledger, digest}`; `eval_plan` plans a held-out store; `report` and `audit` answer
questions about a plan (stages, epochs, exactly-once). Nothing here imports JAX, Orbax or Grain.
"""
