"""Smoke oracle and throughput harness behind `trellis bench`."""
