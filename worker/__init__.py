"""The worker: holds the paged KV pool and runs the model for each StepPlan the scheduler sends."""
