"""The fleet on the engines clusters already have: Ray here; Kubernetes and Slurm in deploy/.

Every engine starts the same thing: ordinary `vramtune worker` processes, one per card, each
pulling trials from the service. What an engine adds is where they run and who restarts them;
the memory-aware part (predict, resize, hand back, route) stays the worker's and the service's.
"""
