"""The one route type both integrations name their routes from (faircast_ds.shard.routes)."""
from __future__ import annotations

import ast

import pytest
from package_scan import ROOT, modules

def test_one_route_type_for_both_frameworks():
    from faircast_ds.shard import routes

    assert routes.resolve_choice("auto", has_hook=lambda: True) == "hook"
    assert routes.resolve_choice("auto", has_hook=lambda: False) == "runtime"
    assert routes.resolve_choice("runtime", has_hook=lambda: True) == "runtime"
    with pytest.raises(ValueError, match="route must be one of 'auto', 'runtime', 'hook', got 'patched'"):
        routes.resolve_choice("patched", has_hook=lambda: True)
    assert {routes.kind(f, c) for f in ("deepspeed", "megatron") for c in ("runtime", "hook")} == set(routes.KINDS)
    with pytest.raises(ValueError, match="unknown route kind 'deepspeed-runtim'"):
        routes.Route(adapter=None, kind="deepspeed-runtim")


def test_every_route_is_named_from_the_route_type():
    """No module spells a route kind out as a string literal but routes.py."""
    from faircast_ds.shard import routes

    offenders = []
    for name, path in modules().items():
        if name == "faircast_ds.shard.routes":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in routes.KINDS:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not offenders, offenders
