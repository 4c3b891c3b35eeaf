"""The ``kvarn-compile`` command line: ``demo``, ``eval`` and ``plan`` (``main.py``)."""
