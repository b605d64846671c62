"""``deepspeed.moe``: mixture-of-experts layers are not implemented in zerodp (:mod:`.layer` refuses
them); :mod:`.utils` has the helpers scripts import, which leave models without MoE layers unchanged."""
