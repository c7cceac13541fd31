"""Estimates that run the job: traced on fake tensors, measured on real ranks, the tracker (torch)."""
