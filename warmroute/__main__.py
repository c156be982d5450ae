from warmroute.cli import main

raise SystemExit(main())
