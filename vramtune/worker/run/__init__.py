"""Running a trial for real: the training loop of torch tasks (`training`), and the slot
processes that let several trials share a card (`slots`, `slot_process`)."""
