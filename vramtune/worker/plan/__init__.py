"""Choosing how a trial runs here: the fit policy's plan ladder, routing by predicted time, and
the fleet's shared predictions."""
