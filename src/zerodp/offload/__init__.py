"""ZeRO-Offload and ZeRO-Infinity: optimizer states and gradients (:mod:`.host`, :mod:`.nvme`) and
stage-3 parameter shards (:mod:`.param_swap`) kept in host memory or NVMe swap files, moved by an
asynchronous direct-I/O swapper (:mod:`.aio`).
"""
