"""The rollout role: a worker that leases prompt groups, drives its inference engine and loads new weights."""
