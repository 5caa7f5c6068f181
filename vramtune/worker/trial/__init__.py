"""What a trial is to the worker: the task interface a user writes (`task`), the seam between
the agent and whatever runs a trial (`runner`), and one optimizer step under a plan (`steps`),
the code path the trainer runs and the predictor traces."""
