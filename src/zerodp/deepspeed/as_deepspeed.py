"""``import zerodp.deepspeed.as_deepspeed``: register :mod:`zerodp.deepspeed` as the ``deepspeed`` module
(:func:`zerodp.deepspeed.registration.install`), so that HF transformers' ``Trainer(deepspeed=...)`` and
accelerate, which import ``deepspeed`` themselves, run on zerodp. Put it first in the script, before
transformers or accelerate is imported. Raises
:class:`~zerodp.deepspeed.registration.DeepSpeedShadowError` where a real DeepSpeed is installed."""

from zerodp.deepspeed.registration import install

install()
