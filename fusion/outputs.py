"""Hugging Face's output capture (transformers >= 5) seen from fused blocks.

transformers records hidden states and attention probabilities with forward hooks it installs
on a model's layers and attention modules on the first call that asks for them
(`output_hidden_states`, `output_attentions`: an evaluation, a feature extraction) and keeps for
good. Each hook reads the active collector from a ContextVar, whose `get` Dynamo cannot trace:
every block capture broke right after its attention (GPT-2 with eager attention: three graphs a
block and its attention unfused, as its probabilities left the first graph; WavLM likewise).
transformers' own answer under torch.compile is the collector's "compiling" mode, which keeps
the value in a plain attribute; a block's call runs in that mode with the value its eager caller
set (None; an empty dict; or the dict the hooks fill, when outputs are asked for).
"""
import sys
from typing import Any

_found: list[Any] = [None]  # the collector, once found


def output_collector() -> Any:
    """transformers' collector when transformers is imported and the collector has the
    attributes used here; else None."""
    if _found[0] is None:
        module = sys.modules.get("transformers.utils.output_capturing")
        collector = getattr(module, "_active_collector", None)
        needed = ("context_var", "compiling", "global_var")
        if collector is not None and all(hasattr(collector, a) for a in needed):
            _found[0] = collector
    return _found[0]


def _collected() -> Any:
    """What the hooks collect into on this call: None, an empty dict, or a dict keyed by output."""
    collector = output_collector()
    if collector is None:
        return None
    return collector.global_var if collector.compiling else collector.context_var.get()


def collecting_outputs() -> bool:
    """True while a transformers model collects outputs through its hooks (eager callers)."""
    return bool(_collected())


def collector_active() -> bool:
    """True inside a transformers model that collects its outputs by hooks (collecting or not);
    False outside one, and in a model that gathers its layers' outputs itself (BridgeTower's)."""
    return _collected() is not None


def collecting_attentions() -> bool:
    """True while a transformers model collects attention probabilities through its hooks (a key
    of the collector's dict ending in "attentions": self-, cross-, a mask decoder's)."""
    value = _collected()
    if not isinstance(value, dict):
        return bool(value)
    return any(str(key).endswith("attentions") for key in value)


def collector_to_global() -> tuple[Any, Any] | None:
    """Puts the collector in its "compiling" mode holding the caller's value, for the duration of
    a block's Dynamo call; returns what `collector_restore` puts back (None: nothing to restore:
    transformers not imported, or the call already inside a torch.compile)."""
    collector = output_collector()
    if collector is None or collector.compiling:
        return None
    prior = collector.global_var
    collector.global_var = collector.context_var.get()
    collector.compiling = True
    return collector, prior


def collector_restore(token: tuple[Any, Any] | None) -> None:
    if token is not None:
        collector, prior = token
        collector.compiling = False
        collector.global_var = prior
