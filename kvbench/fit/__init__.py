"""Before a job evaluates, it fits: calibration statistics (:mod:`.statistics`), then the free
parameters chosen on held-out calibration windows (:mod:`.heldout`) through one search protocol
(:mod:`.search`): the K/V split (:mod:`.kv_split`), compose's budget share (:mod:`.budget_share`),
cobra_plus's switches (:mod:`.cobra_plus_select`); and the layer sensitivity, a measurement on
calibration windows (:mod:`.layer_sensitivity`). Every step reads a
:class:`kvbench.context.JobContext`, never the job."""
