"""The public functional API: ``functional`` (sde_step, step_log_prob, step_kl), the per-step weights
(``weights``) and their sequence-parallel form (``distributed``). Builds a spec (``flowrl.core``) and
calls a backend (``flowrl.backends``)."""
