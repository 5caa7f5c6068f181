"""``python -m vramtune``: the vramtune command line."""

from vramtune.service.cli.parser import main

raise SystemExit(main())
