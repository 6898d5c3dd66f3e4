from speedrun.cli import main

raise SystemExit(main())
