"""Stage 1 of the pipeline: measure the model and the process group's collectives."""

from lightning_osdp.profiling.model_profile import CollectiveFit, ModelProfile, ModuleProfile

__all__ = ["CollectiveFit", "ModelProfile", "ModuleProfile"]
