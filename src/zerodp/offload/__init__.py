"""ZeRO-Offload and ZeRO-Infinity (reserved): optimizer states, gradients and parameters kept in CPU
memory or on NVMe, with an asynchronous swapper. Not implemented yet; configs that ask for offload
are refused by :mod:`zerodp.config`.
"""
