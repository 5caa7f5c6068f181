"""``python -m service``: the vramtune command line."""

from service.cli import main

raise SystemExit(main())
