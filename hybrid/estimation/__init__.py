"""Closed-form estimates of one layout: memory per GPU and step time (pure, no torch)."""
