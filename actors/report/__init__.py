"""What a run tells its user as it goes and when it ends: the progress line, the run's clock, the summary and plots,
and the integrity certificate read back from the run directory's metrics."""
