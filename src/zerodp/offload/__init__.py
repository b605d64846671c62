"""ZeRO-Offload and ZeRO-Infinity: optimizer states and gradients (:mod:`.host`, :mod:`.nvme`) and
stage-3 parameter shards (:mod:`.param_offload`: NVMe swap files, :mod:`.param_swap`, or host homes of
device shards, :mod:`.param_home`) kept in host memory or NVMe swap files, moved by an asynchronous
direct-I/O swapper (:mod:`.aio`) and, with the engine on a device, a copy stream (:mod:`.stream`).
"""
