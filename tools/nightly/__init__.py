"""The nightly regression gate (``python -m tools.nightly``, ``make
nightly``): ``run`` measures and decides, ``figures`` turns a run into
figures, ``check`` compares them with the baseline (``TOLERANCES``),
``trend`` writes the trend page."""
