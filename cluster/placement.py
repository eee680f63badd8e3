"""Placement groups: each engine's resources reserved as one unit before its actor starts.

One placement group per engine, ``STRICT_PACK``: an SGLang TP group must sit on one node, and a
reservation that outlives the actor means a replacement actor (after preemption or a crash) gets
the same GPUs back instead of racing other jobs for them. The group holds one bundle with all the
engine's GPUs, because SGLang starts its TP workers as subprocesses of the actor and they can only
use GPUs visible to it (``ray.data.llm``'s SGLang stage reserves ``tp_size`` GPUs per actor for the
same reason).
"""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..errors import LonggenError
from .spec import JobSpec


def engine_bundle(spec: JobSpec) -> dict[str, float]:
    bundle = {"CPU": float(spec.engines.cpus)}
    if spec.gpus_per_engine:
        bundle["GPU"] = float(spec.gpus_per_engine)
    return bundle


def reserve(spec: JobSpec, name: str, timeout_s: float) -> list[PlacementGroup]:
    """One ready placement group per engine, or a clear error saying what the cluster lacks."""
    bundle = engine_bundle(spec)
    groups = [placement_group([bundle], strategy="STRICT_PACK", name=f"{name}/engine-{i}")
              for i in range(spec.engines.count)]
    ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout_s)
    if len(ready) < len(groups):
        for g in groups:
            remove_placement_group(g)
        raise LonggenError(
            f"the cluster could not place {spec.engines.count} engine(s) of {bundle} within {timeout_s:.0f} s "
            f"(only {len(ready)} fit; cluster resources: {_short(ray.cluster_resources())}, available now: "
            f"{_short(ray.available_resources())}); lower engines.count, engines.tp_size or engines.cpus"
        )
    return groups


def strategy(group: PlacementGroup) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=0,
                                            placement_group_capture_child_tasks=True)


def release(groups: list[PlacementGroup]) -> None:
    for g in groups:
        try:
            remove_placement_group(g)
        except Exception:  # already gone with the cluster
            pass


def _short(resources: dict) -> dict:
    return {k: v for k, v in resources.items() if k in ("CPU", "GPU", "memory") or k.startswith("accelerator")}
