"""Entry points: ``python -m flowrl demo`` (``demo``) and ``python -m flowrl example`` (``example``)."""
