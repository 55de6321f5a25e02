"""A speed-up of Triton's interpreter for the test suite (tests/conftest.py installs it, and
tests/gloo_ranks.py in each spawned rank): the interpreted kernels are most of the suite's time."""


def patch_each_launch_once():
    """Triton's interpreter patches triton.language into interpreted builtins at each kernel launch
    (GridExecutor, restored after it) and again at each call of a nested @triton.jit function, which
    finds the modules already patched: that repeat (inspect.getmembers over triton.language, hundreds
    of calls a launch) took about a seventh of an interpreted test's time (one of
    test_per_token_runs.py's: 28.7 s, 24.6 s without). Inside a launch, a nested function whose
    triton.language modules (tl, or tl.core for tl.sum and the like) the launch has patched already
    skips the repeat; the first call that needs another patches as before. Installed only where the
    interpreter has that structure (triton 3.6 to 3.9); tests/backends/test_interpreter_launches.py checks
    that it gives the same bits with fewer patches. A no-op unless TRITON_INTERPRET is on."""
    from flowrl.backends._dispatch import interpreter_enabled

    if not interpreter_enabled():
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    if not all(hasattr(interpreter, n) for n in ("_patch_lang", "GridExecutor", "_LangPatchScope", "tl")) \
            or getattr(interpreter, "_flowrl_patched_once", False):
        return
    patch_lang, grid_call = interpreter._patch_lang, interpreter.GridExecutor.__call__
    patched = []  # per active launch: the modules its own patch covered (None until it has patched)
    langs_of = {}

    def langs(fn):
        key = id(fn.__globals__)
        if key not in langs_of:
            langs_of[key] = frozenset(id(v) for v in fn.__globals__.values()
                                      if v is interpreter.tl or v is interpreter.tl.core)
        return langs_of[key]

    def patch_lang_once(fn):
        if patched and patched[-1] is not None and langs(fn) <= patched[-1]:
            return interpreter._LangPatchScope()  # nothing to restore: the launch's scope restores
        scope = patch_lang(fn)
        if patched:  # a nested call's patch is never restored (upstream): its modules stay patched
            patched[-1] = langs(fn) | (patched[-1] or frozenset())
        return scope

    def launch(self, *args, **kwargs):
        patched.append(None)
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()

    interpreter._flowrl_unpatched = (patch_lang, grid_call)
    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = launch
    interpreter._flowrl_patched_once = True
