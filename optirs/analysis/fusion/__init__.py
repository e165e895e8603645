"""Elementwise kernel fusion: a graph of tensor ops, a planner that groups them into kernels, and
the generated kernels that run a plan on any backend with the ``fusion`` capability.

Modules, each using only those before it: :mod:`~optirs.analysis.fusion.ops` (the op vocabulary,
spelt once per language), :mod:`~optirs.analysis.fusion.graph` (:class:`FusionGraph`),
:mod:`~optirs.analysis.fusion.execution` (running compiled groups through the bound backend),
:mod:`~optirs.analysis.fusion.planner` (:class:`FusionPlanner`, :class:`FusionPlan`) and
:mod:`~optirs.analysis.fusion.codegen` (source text per dialect). This package is also the
``fusion`` analysis plugin: it answers ``optirs_fusion_generate`` with codegen's output, which is
how a plan gets its sources without the planner importing codegen.
"""

from __future__ import annotations

from typing import Dict, Optional

from optirs.analysis.fusion import codegen
from optirs.analysis.fusion.execution import CompiledPlan
from optirs.analysis.fusion.graph import FusionGraph, FusionOp, OpKind, evaluate_op_numpy
from optirs.analysis.fusion.planner import FusionGroup, FusionPlan, FusionPlanner
from optirs.plugin.hookspecs import FusedGroupSource, hookimpl

__all__ = ["OpKind", "FusionOp", "FusionGraph", "FusionGroup", "FusionPlan", "FusionPlanner", "CompiledPlan",
           "evaluate_op_numpy", "plugin"]


class FusionPlugin:
    """The ``fusion`` analysis plugin: lists the planner for ``optirs info`` and generates group sources."""

    @hookimpl
    def optirs_plugin_info(self) -> Dict[str, str]:
        return {
            "summary": "elementwise kernel-fusion planner (exact search up to 12 ops, greedy beyond) "
                       "with generated fused kernels for every backend with the fusion capability",
        }

    @hookimpl
    def optirs_fusion_generate(self, graph: FusionGraph, group: FusionGroup) -> Optional[FusedGroupSource]:
        return codegen.group_source(graph, group)


plugin = FusionPlugin()
