"""The fleet: workers and their heartbeats (workers.py), trial calls under a lease (trials.py),
leases, routing of trials that do not fit, the reaper, and calibration served to workers."""
