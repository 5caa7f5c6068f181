"""The card a worker drives: NVML facts (`gpu`) and the live tensor bytes of a run (`memory`)."""
