"""numpy compatibility for numba-cuda, applied before numba-cuda is imported anywhere in the pack.

numpy 2.5 removed ``np.row_stack`` (deprecated since numpy 2.0 as an alias of ``np.vstack``);
numba-cuda 0.30.x still calls it.  Rather than pin ``numpy<2.5`` (which would make pip
downgrade numpy in a user's ComfyUI environment), the missing name is pointed at ``np.vstack``
-- the function it was an alias of -- and only when it is missing: with numpy < 2.5 nothing is
changed.  Measured on numpy 2.5.2, numba 0.68, numba-cuda 0.30.4: kernels compile and run.

No imports from the pack here: ``_pack.load()`` runs this file on its own.
"""


def apply(np_module=None) -> bool:
    """Add ``row_stack = vstack`` to ``np_module`` (numpy by default) when it lacks ``row_stack``.

    Returns True when the alias was added, False when nothing was changed."""
    if np_module is None:
        try:
            import numpy as np_module
        except ImportError:  # pragma: no cover - numpy is a dependency
            return False
    if hasattr(np_module, "row_stack") or not hasattr(np_module, "vstack"):
        return False
    np_module.row_stack = np_module.vstack
    return True


APPLIED = apply()
