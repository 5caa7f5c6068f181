"""The fleet: workers and their heartbeats (workers.py), which trial a worker gets (dispatch.py),
trial calls under a lease (trials.py), leases, routing of trials that do not fit, the reaper,
and the calibration served to workers."""
