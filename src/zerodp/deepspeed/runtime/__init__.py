"""``zerodp.deepspeed.runtime``: the places DeepSpeed clients import from (``deepspeed.runtime.*``)."""
