"""Resilience harnesses: the chaos matrix (kill -9, stalls, bus faults, each run audited) and the long soak."""
