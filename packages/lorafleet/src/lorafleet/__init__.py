"""Shared runtime of every lorafleet service.

Contracts, gRPC server and channels, errors, settings, logging and metrics.
"""
