"""The built-in inference engine and its HTTP server (`tandem inference`); see docs/inference.md.

The bodies it speaks are `tandem.wire`, which clients import without the engine.
"""
