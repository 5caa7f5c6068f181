"""Built-in tasks: real data that needs no download (scikit-learn's digits, the stdlib's source)."""
