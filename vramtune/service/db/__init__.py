"""vramtune's database: engine and sessions (engine.py), its tables (tables.py), and schema
upgrades (migrate.py, which runs migrations/)."""
