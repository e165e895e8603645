"""A plugin whose hook takes an argument the specification does not have."""

from optirs.plugin.hookspecs import ProbeResult, hookimpl


@hookimpl
def optirs_probe(options, device_index):
    return ProbeResult(True)
