from pipeline.commands.cli import main

raise SystemExit(main())
