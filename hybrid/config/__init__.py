"""Job options, job files, the cluster and GPU catalogue, what is trained (pure, no torch)."""
