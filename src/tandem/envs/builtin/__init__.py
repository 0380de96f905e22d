"""Built-in tasksets, registered by id in `tandem.envs.registry`."""
