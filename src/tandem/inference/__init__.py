"""The built-in inference engine and its HTTP server (`tandem inference`); see docs/inference.md.

Nothing is imported here, so `tandem.inference.protocol` and `tandem.inference.kept_ids` (what clients and
the trainer need) load without torch or the engine.
"""
