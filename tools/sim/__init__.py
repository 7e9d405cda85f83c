"""Simulated compute: the real actors driven by cost-modelled engines and trainers, and a cluster-scale simulator."""
