"""The learner role: pulls batches, runs the training step across its ranks and publishes weights."""
