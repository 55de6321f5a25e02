"""The backends and their table: the torch reference (``reference``, the oracle; ``reference_losses``,
the losses' half), the Triton launchers (``_triton_ops``, ``_triton_losses``) and ``_dispatch``, which
picks one for the public ops and the losses alike. Reads ``flowrl.core`` and ``flowrl.contract``."""
