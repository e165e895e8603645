"""A plugin with a misspelt hook name: pluggy's check_pending catches it."""

from optirs.plugin.hookspecs import ProbeResult, hookimpl


@hookimpl
def optirs_probe(options):
    return ProbeResult(True)


@hookimpl
def optirs_step_adamm(ctx, params, grads, state, layout, scalars):
    raise AssertionError("never called")
