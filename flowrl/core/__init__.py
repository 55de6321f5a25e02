"""The math contract in code: the argument checks (``_validate``) and the validated step description
(``step_spec.StepSpec``) every backend reads. Above ``flowrl.contract``, below everything else."""
