"""A plugin whose import fails, as one with a missing dependency would."""

raise RuntimeError("this plugin cannot be imported (deliberately broken)")
