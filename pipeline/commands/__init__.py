"""The `pipeline` command line: `cli` dispatches to one module per group of subcommands."""
