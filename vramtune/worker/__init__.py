"""vramtune's worker: the agent that runs trials on one GPU (or a simulated card)."""
