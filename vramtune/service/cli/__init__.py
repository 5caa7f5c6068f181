"""The ``vramtune`` command line: the parser (parser.py), the server and study commands
(commands.py), how they print (console.py) and ``vramtune demo`` (demo.py)."""
