"""Cluster placement: one resource plan for colocated and fully-async runs (`plan`), its memory
estimate (`memory`), and its realisation as Ray placement groups (`cluster`)."""

from rlactors.placement.plan import ClusterShape, Node, PlanError, ResourcePlan, make_plan, trainer_roles

__all__ = ["ClusterShape", "Node", "PlanError", "ResourcePlan", "make_plan", "trainer_roles"]
