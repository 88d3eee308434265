"""JSON request bodies, as the SDK 0.38 sends them (tinker-protocol.md §3, §4).

FastAPI validates bodies against these models, so a wrong type or a missing field
becomes a 422 naming the field before any handler runs. Unknown keys are ignored:
newer SDKs add fields, and the protocol's ``type`` literals carry no information.
"""

from __future__ import annotations

from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from nexrl_core.config.adamw import AdamWSettings
from nexrl_core.config.lora import LoraSettings
from nexrl_service.runtime import SeqId, StoredInt

__all__ = [
    "AdamParamsBody",
    "CreateModelBody",
    "CreateSamplingSessionBody",
    "CopyWeightsBody",
    "CreateSessionBody",
    "FinishSessionBody",
    "HeartbeatBody",
    "LoadWeightsBody",
    "LoraConfigBody",
    "ModelIdBody",
    "ModelInputBody",
    "OptimStepBody",
    "RetrieveFutureBody",
    "SampleBody",
    "SamplingParamsBody",
    "SaveWeightsBody",
    "SaveWeightsExternalBody",
    "SaveWeightsForSamplerBody",
]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSessionBody(Body):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None


class HeartbeatBody(Body):
    session_id: str


class FinishReason(Body):
    type: str = "success"


class FinishSessionBody(Body):
    reason: FinishReason | None = None
    detail: str | None = None


class LoraConfigBody(Body):
    rank: int = Field(strict=True, ge=0, le=4096)
    seed: StoredInt | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True

    def settings(self) -> LoraSettings:
        """The engine's LoRA record (Tinker's wire has no alpha: the default applies)."""
        return LoraSettings(rank=self.rank, train_mlp=self.train_mlp, train_attn=self.train_attn, train_unembed=self.train_unembed)


class OptimizerConfigBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = "adamw"


class CreateModelBody(Body):
    session_id: str
    model_seq_id: SeqId
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfigBody | None = None
    optimizer_config: OptimizerConfigBody | None = None


class ModelIdBody(Body):
    model_id: str


class AdamParamsBody(Body):
    """Tinker's ``AdamParams`` with Tinker's defaults (eps 1e-12, no weight decay, no clipping),
    which an SDK call that leaves a field out means."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def settings(self) -> AdamWSettings:
        """The engine's AdamW record; a value out of range raises ``ValueError`` naming it."""
        return AdamWSettings(**self.model_dump())


class OptimStepBody(Body):
    model_id: str
    seq_id: SeqId | None = None
    adam_params: AdamParamsBody | None = Field(default=None, validation_alias=AliasChoices("adam_params", "optim_params"))
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsBody(Body):
    model_id: str
    path: str | None = None
    seq_id: SeqId | None = None
    ttl_seconds: int | None = Field(default=None, ge=1)
    overwrite: bool = False
    user_metadata: dict[str, Any] | None = None


class SaveWeightsForSamplerBody(Body):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: SeqId | None = None
    kind: str = "snapshot"
    seq_id: SeqId | None = None
    ttl_seconds: int | None = Field(default=None, ge=1)
    user_metadata: dict[str, Any] | None = None


class SaveWeightsExternalBody(Body):
    model_id: str
    path: str
    seq_id: SeqId | None = None
    ttl_seconds: int | None = Field(default=None, ge=1)
    age_encryption_recipients: list[str] | None = None


class CopyWeightsBody(Body):
    source_path: str
    destination_project_id: str | None = None
    session_id: str | None = None
    model_seq_id: SeqId | None = None
    ttl_seconds: int | None = None
    """Checked by `nexrl_tinker.server.runs.check_ttl` (1 hour to 10 years)."""
    weights_access_token: str | None = None


class LoadWeightsBody(Body):
    model_id: str | None = None
    seq_id: SeqId | None = None
    session_id: str | None = None
    model_seq_id: SeqId | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool = False
    optimizer_config: OptimizerConfigBody | None = None


class CreateSamplingSessionBody(Body):
    session_id: str
    sampling_session_seq_id: SeqId
    base_model: str | None = None
    model_path: str | None = None


class ChunkBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "encoded_text"
    tokens: list[int] | None = None


class ModelInputBody(Body):
    chunks: list[ChunkBody]


class SamplingParamsBody(Body):
    max_tokens: int | None = None
    seed: StoredInt | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class SampleBody(Body):
    num_samples: int = 1
    prompt: ModelInputBody
    sampling_params: SamplingParamsBody
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: SeqId | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None


class RetrieveFutureBody(Body):
    request_id: str
    allow_metadata_only: bool = False
