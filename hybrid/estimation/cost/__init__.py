"""Time of one optimizer step: compute, communication on the cluster's links, elementwise traffic."""
