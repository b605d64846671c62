"""``deepspeed.checkpoint``: :mod:`zerodp.deepspeed.checkpoint.utils`."""
