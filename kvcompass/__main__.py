from kvcompass.cli import main

raise SystemExit(main())
