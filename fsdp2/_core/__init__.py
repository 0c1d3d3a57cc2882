"""The engine behind ``fully_shard`` (private: the public names are in ``fsdp2``)."""
