"""Planning and observing a training step: ``estimate_memory`` and ``timeline``."""
