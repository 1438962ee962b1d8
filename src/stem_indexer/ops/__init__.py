"""Operator registrations and backend kernels."""
