"""Training code as users already write it, wrapped into vramtune Tasks: each module adapts one
framework (Hugging Face `Trainer`, Lightning) and is importable only with its optional extra."""
