"""References run the model as transformers built it, never through our kernels.

An engine packs the model it is given in place: our Linear layers replace transformers', norms and decoder layers
get one-call forwards. A reference computed on that model afterwards would run our kernels and compare them with
themselves, so the references of the model tier run a copy kept at load, before any engine. (A module of its own:
pytest imports conftest.py apart from ``tests.model.conftest``, and the copies must be kept in one place.)
"""

import copy
import weakref

import torch

_AS_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def keeping_transformers_copy(loaded):
    """``loaded``, with a copy of its model as transformers built it kept aside for references."""
    _AS_BUILT[loaded.model] = copy.deepcopy(loaded.model)
    return loaded


def transformers_model(loaded) -> torch.nn.Module:
    """What transformers computes for ``loaded``: the copy kept at its load, or its model where no engine touched it."""
    kept = _AS_BUILT.get(loaded.model)
    if kept is not None:
        return kept
    ours = sorted({type(m).__name__ for m in loaded.model.modules()
                   if type(m).__module__.startswith("app.") or "forward" in m.__dict__})
    assert not ours, f"a reference would run our code ({', '.join(ours)}): load it with keeping_transformers_copy"
    return loaded.model
