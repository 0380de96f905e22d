"""tandem: post-train large language models with asynchronous RL, SFT and evals."""

__version__ = "0.1.0"
