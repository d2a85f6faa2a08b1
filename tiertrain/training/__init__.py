"""Training: the plan of a run (``plan.py``: memory budget, update path, activations, states),
the trainer that builds and runs it (``trainer.py``), its checkpoints (``checkpoints.py``), a
step's figures (``meter.py``) and records (``metrics.py``), the run directory (``rundir.py``)
and the stop flag of Ctrl-C and SIGTERM (``interrupt.py``)."""
