"""The nightly regression run: figures, the baseline check, the trend page."""
