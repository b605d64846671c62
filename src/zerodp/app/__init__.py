"""The demo application built on the library: the ``zerodp`` console script (:mod:`.cli`), the GPT
trainer it launches (:mod:`.train`, :mod:`.model`, :mod:`.data`) and the step-time benchmark
(:mod:`.bench`). The library (everything outside ``zerodp.app``) never imports this package.
"""
