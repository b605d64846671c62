"""``deepspeed.compression``: only :mod:`.helper`'s attribute helpers (compression training is refused
in the config: ``compression_training``)."""
