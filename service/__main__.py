"""``python -m service``: the vramtune command line."""

from service.cli.parser import main

raise SystemExit(main())
