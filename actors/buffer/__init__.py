"""The buffer role: the prompt source, groups in flight, the staleness gate, batches and the durable log."""
