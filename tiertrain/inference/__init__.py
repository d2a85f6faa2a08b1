"""Forward-only use of a model, through the runtime training uses: where its weights come from
(``weights.py``: a model directory's safetensors, their converted copy on the storage tier, a
checkpoint's weights file, those the host budget holds read once), the key/value cache on two
tiers (``kvcache.py``), layer-major generation (``generate.py``) and its prompts and output
(``prompts.py``), ``tiertrain eval`` (``evaluate.py``) and the validation loss of a training
run (``validation.py``). Units are walked as training walks them (``execute/walk.py``)."""
