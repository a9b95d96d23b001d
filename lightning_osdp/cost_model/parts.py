"""Memory by category: what a byte of the predicted peak is (parameters, gradients, ... communication buffers)."""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["CATEGORIES", "MemoryParts"]

#: The categories of :class:`MemoryParts`, in the order they are printed.
CATEGORIES: tuple[str, ...] = (
    "parameters",
    "gradients",
    "optimizer_states",
    "activations",
    "gathered_parameters",
    "communication_buffers",
)


@dataclass(frozen=True)
class MemoryParts:
    """Bytes on one rank, by category. Supports ``+``, ``-`` and comparison by :attr:`total`.

    Attributes:
        parameters: the parameters each rank keeps between steps (padded shards, or full replicas).
        gradients: sharded gradients kept for the optimizer, and unsharded gradients autograd produces.
        optimizer_states: the optimizer's state of the local shards (and temporaries of its step).
        activations: tensors saved for backward, and the forward outputs / backward gradients in flight.
        gathered_parameters: unsharded parameters while a unit is gathered.
        communication_buffers: all-gather output and reduce-scatter input buffers.
    """

    parameters: int = 0
    gradients: int = 0
    optimizer_states: int = 0
    activations: int = 0
    gathered_parameters: int = 0
    communication_buffers: int = 0

    @property
    def total(self) -> int:
        """All categories together."""
        return (
            self.parameters
            + self.gradients
            + self.optimizer_states
            + self.activations
            + self.gathered_parameters
            + self.communication_buffers
        )

    def __add__(self, other: MemoryParts) -> MemoryParts:
        return MemoryParts(
            self.parameters + other.parameters,
            self.gradients + other.gradients,
            self.optimizer_states + other.optimizer_states,
            self.activations + other.activations,
            self.gathered_parameters + other.gathered_parameters,
            self.communication_buffers + other.communication_buffers,
        )

    def __sub__(self, other: MemoryParts) -> MemoryParts:
        return MemoryParts(
            self.parameters - other.parameters,
            self.gradients - other.gradients,
            self.optimizer_states - other.optimizer_states,
            self.activations - other.activations,
            self.gathered_parameters - other.gathered_parameters,
            self.communication_buffers - other.communication_buffers,
        )

    def __neg__(self) -> MemoryParts:
        return ZERO - self

    def as_dict(self) -> dict[str, int]:
        """``{category: bytes}`` plus ``"total"``."""
        out = {f.name: int(getattr(self, f.name)) for f in fields(self)}
        out["total"] = self.total
        return out


ZERO = MemoryParts()
