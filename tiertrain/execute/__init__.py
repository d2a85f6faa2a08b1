"""Executing a step: the layer-major executor (``executor.py``: a step as unit steps over the
model's plan, the vocabulary's pieces in ``vocab.py``), the walk of the parameter store over
the units (``walk.py``, shared with generation) and how micro-batch losses make a step's
(``loss.py``)."""
