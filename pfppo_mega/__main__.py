from pfppo_mega.cli import main

raise SystemExit(main())
