"""What `mmrl add-model` discovers for a model type, and the adapter it renders from it:
the setup the scaffold's rendering tests share."""

from __future__ import annotations


def discovered(model_type: str, family: str):
    """The scaffold's discovery for `model_type` under the name `family` (its tiny inputs
    built and the family inspected, with transformers' warnings silenced)."""
    from mmrl.scaffold import quiet_transformers
    from mmrl.scaffold.discover import inspect_family
    from mmrl.scaffold.resolve import resolve
    from mmrl.scaffold.tiny_inputs import tiny_model_inputs

    with quiet_transformers():
        resolved = resolve(model_type)
        return inspect_family(resolved, family, tiny_model_inputs(resolved))


def rendered(found, *, capabilities: bool = True) -> str:
    """The in-tree adapter source for `found`, declaring the capabilities the quick
    checks would start from (`capabilities=False`: none)."""
    from mmrl.scaffold.layout import layout_for
    from mmrl.scaffold.render import base_capabilities, render_adapter

    return render_adapter(found, layout_for(found, None), base_capabilities(found) if capabilities else None)
