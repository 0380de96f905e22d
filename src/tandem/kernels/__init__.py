"""Triton kernels, each checked against a plain-torch reference. Imports nothing else from tandem.

Every kernel here is optional: callers keep the torch path and pick a kernel by a config switch, and
only importing a kernel's module needs Triton.
"""
