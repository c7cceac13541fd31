"""Applying a layout: the mesh, parallelize, the backends and the loop auto_wrap returns (torch)."""
