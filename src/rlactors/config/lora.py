"""The actor's LoRA adapters (`model.lora`): off at rank 0, the default."""

from __future__ import annotations

from pydantic import Field

from rlactors.config.section import Section

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(Section):
    rank: int = Field(
        0, ge=0, description="Rank of the LoRA adapters trained on the actor; 0 trains every weight instead. With "
        "adapters, only they reach the optimizer and the checkpoints, and a KL term's reference policy is the "
        "actor with its adapters switched off (no reference model is loaded).",
    )
    alpha: float = Field(32.0, gt=0, description="LoRA alpha: the adapter's update is scaled by alpha / rank.")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the adapters' input in the update's forward passes (never in the "
        "logprob passes, whose logprobs must be the policy's own).",
    )
    target_modules: list[str] | str = Field(
        default_factory=lambda: list(ALL_LINEAR),
        description="Linear layers that get adapters: a list of module names (a name matches its last "
        "components, as in peft) or one regular expression matched against the whole module path.",
    )
    merge: bool = Field(
        False, description="Send the engines the base weights with the adapters merged in (through the full "
        "weight sync), instead of the adapters alone. For engines or kernels that cannot serve LoRA.",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0
